// AVX-512F path, 16 floats per register. Compiled with -mavx512f -mfma; only called after the
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
    // a / b as a * (1/b): a 14-bit reciprocal estimate refined by one Newton step (error ~2^-28
    // before rounding, within 1-2 ulp of the division) costs far less than vdivps on 512 bits.
    static inline Reg ratio(Reg a, Reg b) {
        const Reg x = _mm512_rcp14_ps(b);
        const Reg refined = _mm512_mul_ps(x, _mm512_fnmadd_ps(b, x, _mm512_set1_ps(2.0f)));
        return _mm512_mul_ps(a, refined);
    }
    static inline Reg max(Reg a, Reg b) { return _mm512_max_ps(a, b); }
    static inline Reg sqrt(Reg a) { return _mm512_sqrt_ps(a); }
    static inline Reg fmadd(Reg a, Reg b, Reg c) { return _mm512_fmadd_ps(a, b, c); }
    static inline Reg fnmadd(Reg a, Reg b, Reg c) { return _mm512_fnmadd_ps(a, b, c); }
};
}  // namespace

void ftk::step_range_avx512(const StepArgs& args, int64_t begin, int64_t end) {
    dispatch_step<Avx512Ops>(args, begin, end);
}

bool ftk::grad_finite_avx512(const void* grad, ElemType type, int64_t begin, int64_t end) {
    return grad_finite<Avx512Ops>(grad, type, begin, end);
}
