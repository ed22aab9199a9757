// AVX-512F path, 16 floats per register. Compiled with -mavx512f (no -mfma); only called after the
// runtime check in bindings.cpp (best_supported_level) says the CPU (and the OS, via XCR0)
// supports AVX-512F.
#include <immintrin.h>
#include "step_body.h"

namespace {
struct Avx512Ops {
    using Reg = __m512;
    static constexpr int kWidth = 16;
    static inline Reg zero() { return _mm512_setzero_ps(); }
    static inline Reg set1(float x) { return _mm512_set1_ps(x); }
    static inline Reg load(const float* p) { return _mm512_loadu_ps(p); }
    static inline Reg load_bf16(const uint16_t* p) {
        __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
        return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
    }
    static inline void store(float* p, Reg x) { _mm512_storeu_ps(p, x); }
    static inline void prefetch(const void* p) { __builtin_prefetch(p, 0, 3); }
    static inline Reg add(Reg a, Reg b) { return _mm512_add_ps(a, b); }
    static inline Reg sub(Reg a, Reg b) { return _mm512_sub_ps(a, b); }
    static inline Reg mul(Reg a, Reg b) { return _mm512_mul_ps(a, b); }
    static inline Reg div(Reg a, Reg b) { return _mm512_div_ps(a, b); }
    static inline Reg max(Reg a, Reg b) { return _mm512_max_ps(a, b); }
    static inline Reg min(Reg a, Reg b) { return _mm512_min_ps(a, b); }
    static inline Reg sqrt(Reg a) { return _mm512_sqrt_ps(a); }
    // 32-bit integer lanes: counter_rng's hash and the bf16 rounding of the compact state.
    using IReg = __m512i;
    static inline IReg iset1(uint32_t x) { return _mm512_set1_epi32(static_cast<int>(x)); }
    static inline IReg iota() { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
    static inline IReg iload(const uint32_t* p) { return _mm512_loadu_si512(p); }
    static inline void istore(uint32_t* p, IReg x) { _mm512_storeu_si512(p, x); }
    static inline IReg iadd(IReg a, IReg b) { return _mm512_add_epi32(a, b); }
    static inline IReg ixor(IReg a, IReg b) { return _mm512_xor_si512(a, b); }
    static inline IReg iand(IReg a, IReg b) { return _mm512_and_si512(a, b); }
    static inline IReg imul(IReg a, IReg b) { return _mm512_mullo_epi32(a, b); }
    template <int N> static inline IReg isrl(IReg a) { return _mm512_srli_epi32(a, N); }
    // Per lane: `if_nan` where x is a NaN, else `otherwise` (the bf16 stores' NaN guard).
    static inline IReg select_nan(Reg x, IReg if_nan, IReg otherwise) {
        return _mm512_mask_mov_epi32(otherwise, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), if_nan);
    }
    static inline IReg bits(Reg x) { return _mm512_castps_si512(x); }
    static inline void store_hi16(uint16_t* p, IReg u) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
    }
};
}  // namespace

void ftk::step_range_avx512(const StepArgs& args, int64_t begin, int64_t end) {
    dispatch_step<Avx512Ops>(args, begin, end);
}

void ftk::sr_bits_avx512(uint32_t key, int64_t index_base, int64_t n, uint32_t* out) {
    SrBits<Avx512Ops>::range(key, index_base, n, out);
}

bool ftk::grad_finite_avx512(const void* grad, ElemType type, int64_t begin, int64_t end) {
    return grad_finite<Avx512Ops>(grad, type, begin, end);
}
