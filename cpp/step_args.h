// Shared, ISA-neutral description of one fused optimizer step over a flat range of elements.
// Every update rule (AdamW, BERTAdam, RecAdam, prior_wd) is this one element program with
// different coefficients:
//
//   p <- p - pre_decay * p                  (AdamW: decoupled decay before the step)
//   p <- p - pre_pull * (p - a)             (prior_wd: pull toward the anchor, applied first)
//   m <- beta1 * m + (1 - beta1) * g
//   v <- beta2 * v + (1 - beta2) * g * g
//   p <- p - step_size * m / (sqrt(v) * denom_scale + eps)
//   p <- p - post_pull * (p - a)            (RecAdam: annealed pull, after the Adam step)
//   p <- p - post_decay * p                 (BERTAdam / RecAdam: decay toward zero, last)
//
// It is evaluated in "delta form": the total change e is accumulated from small terms, using the
// difference d = p - a taken once from the stored values, and p is rounded once (p <- p - e).
// Applying the five lines literally rounds p three times per step, and over 200 steps that fp32
// noise alone exceeds the 2e-6 (relative) accuracy target against a float64 reference.
//
// The anchor terms run only when an anchor pointer is given. Python computes the coefficients
// (bias corrections, lambda(t)) once per tensor, so the kernel is one pass over memory.
//
// The per-element importance F~ (an anchored tensor's normalised Fisher, bf16, optional): where it
// is given, each pull's fraction becomes per element
//
//   w_i = min(fp32(w) * fp32(F~_i), 1)      (w = pre_pull or post_pull; one rounded product, no FMA)
//
// and the decays never read it. The clamp keeps an element from being pulled past theta* (w_i = 1
// lands on it); with F~ = 1 and w <= 1, w_i = w and the step is the unweighted one bit for bit.
// Without F~ the kernel runs the unweighted loop (a separate instantiation, no extra load).
//
// The inverse step (StepArgs::inverse) undoes one step from the same coefficients and the same
// gradient, with no copy of the old state (the overlapped offload speculates and rolls back):
//
//   u  = step_size * m' / (sqrt(v') * denom_scale + eps)    (bit for bit the forward's Adam term)
//   p' = (1 - A) * p - B   is affine in p: A depends only on the coefficients and B on u and the
//        anchor (B = the forward's change evaluated at p = 0), so  p = (p' + B) / (1 - A)
//   m  = (m' - (1 - beta1) * g) / beta1
//   v  = max(0, (v' - (1 - beta2) * g * g) / beta2)
//
// With F~ the pulls' fractions are per element, so A is too: the caller's inv_keep is then
// 1 / (1 - A) of the decays alone, and each element divides it by (1 - w_pre_i) (1 - w_post_i) in
// fp32 (a few ulp more); a step whose largest w_i reaches 1 cannot be undone (the binding refuses).
// The restored values are within a few ulp of the old ones (the forward rounded once). With
// beta = 0 the old moment is gone from m' (and never read again by a later step): it becomes 0.
// A non-finite gradient cannot be undone: guarded steps check the gradient first (grad_finite_*)
// and leave the tensor untouched.
#pragma once
#include <cstdint>

namespace ftk {

enum class ElemType : int { F32 = 0, BF16 = 1 };

struct StepCoeffs {
    float beta1, beta2, eps;
    // 1 - beta, rounded once from double by the caller: 1.0f - fp32(0.999) is off by 1.3e-5.
    float one_minus_beta1, one_minus_beta2;
    float denom_scale;   // multiplies sqrt(v): 1/sqrt(1-beta2^t) for torch-AdamW semantics, else 1
    float step_size;     // multiplies m / denom
    float pre_decay;     // fraction of p removed before the step (0 = none)
    float pre_pull;      // fraction of (p - a) removed before the step (0 = none)
    float post_pull;     // fraction of (p - a) removed after the step (0 = none)
    float post_decay;    // fraction of p removed at the end (0 = none)
};

struct StepArgs {
    float* param;
    const void* grad;          // F32 or BF16, see grad_type
    float* exp_avg;
    float* exp_avg_sq;
    const void* anchor;        // nullptr: no anchor terms
    ElemType grad_type;
    ElemType anchor_type;
    StepCoeffs c;
    // The per-element importance F~ as bf16 bits (nullptr: none; only beside an anchor): each pull's
    // fraction is min(w * F~_i, 1), see above.
    const uint16_t* importance = nullptr;
    bool inverse = false;  // undo the step described by c instead of taking it
    float inv_keep = 1.0f; // 1 / (1 - A) of the comment above, from the coefficients (inverse only;
                           // with importance, of the decays alone)
    // The compact state (optimizer.state_dtype bfloat16, docs/optimizers.md): exp_avg and exp_avg_sq
    // point to bf16 bit patterns; m is stored rounded to nearest even, v stochastically rounded with
    // the top 16 of 32 counter_rng bits of (sr_key, index_base + element). With an anchor and a
    // delta the master is delta = theta - theta* (fp32): p - a is delta exactly, delta <- delta - e,
    // and param is written as a + delta. With an anchor and no delta, param is the fp32 master
    // (another library owns it: DeepSpeed's partitions) and p - a is rounded once. No inverse:
    // stochastic rounding cannot be undone.
    //
    // The bf16 weight form (the device-lean offload's): with weight16 set, the new weight theta is
    // also stored rounded to nearest even as bf16 into weight16, and a delta master keeps no fp32
    // weight at all (param is not read or written: theta = anchor + delta is formed in registers).
    // weight16 may be the bf16 gradient itself: each element's gradient is loaded before its
    // weight is stored, so the step reads the gradient and writes the weight in its place.
    bool compact = false;
    float* delta = nullptr;   // compact with an anchor only; nullptr there: param is the master
    uint32_t sr_key = 0;      // counter_rng.stream_key(seed, STREAM_STOCHASTIC_ROUNDING, step)
    int64_t index_base = 0;   // global element index of element 0 (ft_framework/optim/compact.py)
    uint16_t* weight16 = nullptr;  // compact only: the new weight in bf16 (may alias a bf16 grad)
};

// The per-element half of counter_rng's lowbias32 chain. These constants are a copy of
// ft_framework/counter_rng.py's, which owns them; tests/unit/optim/test_compact_state.py checks this
// copy against that one (through the binding's rng_constants) and the bits against random_bits.
constexpr uint32_t kLowbias32Mul1 = 0x7FEB352Du;
constexpr uint32_t kLowbias32Mul2 = 0x846CA68Bu;

// One implementation per instruction set; each processes elements [begin, end).
void step_range_scalar(const StepArgs& args, int64_t begin, int64_t end);
void step_range_avx2(const StepArgs& args, int64_t begin, int64_t end);
void step_range_avx512(const StepArgs& args, int64_t begin, int64_t end);

// 32 counter_rng bits per element of [index_base, index_base + n), written to out (tests compare
// each ISA's vector hash with counter_rng.random_bits).
void sr_bits_scalar(uint32_t key, int64_t index_base, int64_t n, uint32_t* out);
void sr_bits_avx2(uint32_t key, int64_t index_base, int64_t n, uint32_t* out);
void sr_bits_avx512(uint32_t key, int64_t index_base, int64_t n, uint32_t* out);

// Whether every gradient element in [begin, end) is finite (no NaN, no infinity).
bool grad_finite_scalar(const void* grad, ElemType type, int64_t begin, int64_t end);
bool grad_finite_avx2(const void* grad, ElemType type, int64_t begin, int64_t end);
bool grad_finite_avx512(const void* grad, ElemType type, int64_t begin, int64_t end);

}  // namespace ftk
