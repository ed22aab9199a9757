// AVX2 path, 8 floats per register. Compiled with -mavx2 (no -mfma: the program has no FMA); only called after the
// runtime check in bindings.cpp (best_supported_level) says the CPU has AVX2 (and FMA).
#include <immintrin.h>
#include "step_body.h"

namespace {
struct Avx2Ops {
    using Reg = __m256;
    static constexpr int kWidth = 8;
    static inline Reg zero() { return _mm256_setzero_ps(); }
    static inline Reg set1(float x) { return _mm256_set1_ps(x); }
    static inline Reg load(const float* p) { return _mm256_loadu_ps(p); }
    static inline Reg load_bf16(const uint16_t* p) {
        __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
        return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
    }
    static inline void store(float* p, Reg x) { _mm256_storeu_ps(p, x); }
    static inline void prefetch(const void* p) { __builtin_prefetch(p, 0, 3); }
    static inline Reg add(Reg a, Reg b) { return _mm256_add_ps(a, b); }
    static inline Reg sub(Reg a, Reg b) { return _mm256_sub_ps(a, b); }
    static inline Reg mul(Reg a, Reg b) { return _mm256_mul_ps(a, b); }
    static inline Reg div(Reg a, Reg b) { return _mm256_div_ps(a, b); }
    static inline Reg max(Reg a, Reg b) { return _mm256_max_ps(a, b); }
    static inline Reg min(Reg a, Reg b) { return _mm256_min_ps(a, b); }
    static inline Reg sqrt(Reg a) { return _mm256_sqrt_ps(a); }
    // 32-bit integer lanes: counter_rng's hash and the bf16 rounding of the compact state.
    using IReg = __m256i;
    static inline IReg iset1(uint32_t x) { return _mm256_set1_epi32(static_cast<int>(x)); }
    static inline IReg iota() { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
    static inline IReg iload(const uint32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
    static inline void istore(uint32_t* p, IReg x) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), x); }
    static inline IReg iadd(IReg a, IReg b) { return _mm256_add_epi32(a, b); }
    static inline IReg ixor(IReg a, IReg b) { return _mm256_xor_si256(a, b); }
    static inline IReg iand(IReg a, IReg b) { return _mm256_and_si256(a, b); }
    static inline IReg imul(IReg a, IReg b) { return _mm256_mullo_epi32(a, b); }
    template <int N> static inline IReg isrl(IReg a) { return _mm256_srli_epi32(a, N); }
    // Per lane: `if_nan` where x is a NaN, else `otherwise` (the bf16 stores' NaN guard).
    static inline IReg select_nan(Reg x, IReg if_nan, IReg otherwise) {
        return _mm256_blendv_epi8(otherwise, if_nan, _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)));
    }
    static inline IReg bits(Reg x) { return _mm256_castps_si256(x); }
    // The top halves of the 8 lanes as 8 uint16: pack within 128-bit lanes, then gather qwords 0 and 2.
    static inline void store_hi16(uint16_t* p, IReg u) {
        const __m256i hi = _mm256_srli_epi32(u, 16);
        const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(hi, hi), 0x08);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
    }
};
}  // namespace

void ftk::step_range_avx2(const StepArgs& args, int64_t begin, int64_t end) {
    dispatch_step<Avx2Ops>(args, begin, end);
}

void ftk::sr_bits_avx2(uint32_t key, int64_t index_base, int64_t n, uint32_t* out) {
    SrBits<Avx2Ops>::range(key, index_base, n, out);
}

bool ftk::grad_finite_avx2(const void* grad, ElemType type, int64_t begin, int64_t end) {
    return grad_finite<Avx2Ops>(grad, type, begin, end);
}
