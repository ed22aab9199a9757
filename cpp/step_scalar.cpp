// Portable path: one float at a time. Compiled with -fno-tree-vectorize -ffp-contract=off so it
// really is the scalar baseline the vector paths are tested against.
#include <cmath>
#include "step_body.h"

namespace {
struct ScalarOps {
    using Reg = float;
    static constexpr int kWidth = 1;
    static inline Reg zero() { return 0.0f; }
    static inline Reg set1(float x) { return x; }
    static inline Reg load(const float* p) { return *p; }
    static inline Reg load_bf16(const uint16_t* p) {
        uint32_t bits = static_cast<uint32_t>(*p) << 16;
        float out;
        std::memcpy(&out, &bits, sizeof(out));
        return out;
    }
    static inline void store(float* p, Reg x) { *p = x; }
    static inline void prefetch(const void*) {}  // the scalar baseline stays plain
    static inline Reg add(Reg a, Reg b) { return a + b; }
    static inline Reg sub(Reg a, Reg b) { return a - b; }
    static inline Reg mul(Reg a, Reg b) { return a * b; }
    static inline Reg div(Reg a, Reg b) { return a / b; }
    static inline Reg max(Reg a, Reg b) { return a > b ? a : b; }
    static inline Reg min(Reg a, Reg b) { return a < b ? a : b; }   // b where either is a NaN (as minps)
    static inline Reg sqrt(Reg a) { return std::sqrt(a); }
    // 32-bit integer lanes: counter_rng's hash and the bf16 rounding of the compact state.
    using IReg = uint32_t;
    static inline IReg iset1(uint32_t x) { return x; }
    static inline IReg iota() { return 0u; }
    static inline IReg iload(const uint32_t* p) { return *p; }
    static inline void istore(uint32_t* p, IReg x) { *p = x; }
    static inline IReg iadd(IReg a, IReg b) { return a + b; }
    static inline IReg ixor(IReg a, IReg b) { return a ^ b; }
    static inline IReg iand(IReg a, IReg b) { return a & b; }
    static inline IReg imul(IReg a, IReg b) { return a * b; }   // mod 2^32
    template <int N> static inline IReg isrl(IReg a) { return a >> N; }
    // Per lane: `if_nan` where x is a NaN, else `otherwise` (the bf16 stores' NaN guard).
    static inline IReg select_nan(Reg x, IReg if_nan, IReg otherwise) { return x != x ? if_nan : otherwise; }
    static inline IReg bits(Reg x) {
        uint32_t u;
        std::memcpy(&u, &x, sizeof(u));
        return u;
    }
    static inline void store_hi16(uint16_t* p, IReg u) { *p = static_cast<uint16_t>(u >> 16); }
};
}  // namespace

void ftk::step_range_scalar(const StepArgs& args, int64_t begin, int64_t end) {
    dispatch_step<ScalarOps>(args, begin, end);
}

void ftk::sr_bits_scalar(uint32_t key, int64_t index_base, int64_t n, uint32_t* out) {
    SrBits<ScalarOps>::range(key, index_base, n, out);
}

bool ftk::grad_finite_scalar(const void* grad, ElemType type, int64_t begin, int64_t end) {
    return grad_finite<ScalarOps>(grad, type, begin, end);
}
