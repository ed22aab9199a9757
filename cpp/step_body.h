// The element program of step_args.h, written once over a vector-ops type `V`.
// Included by exactly one translation unit per instruction set, each compiled with its own
// -m flags. Everything here has internal linkage (anonymous namespace) so the linker can never
// merge an AVX-512 instantiation into the scalar path (that would crash older CPUs).
#pragma once
#include <cstdint>
#include <cstring>
#include "step_args.h"

namespace {

// The word whose top half every program stores for a NaN bf16 moment: bf16's positive quiet NaN
// (optim/compact.py BF16_NAN_BITS, the owner; tests/unit/optim/test_nan_bits.py checks the two agree).
constexpr uint32_t kBf16NanWord = 0x7FC00000u;

// HasPre / HasPostDecay drop the stages a rule does not use (RecAdam has no pre-step decay or
// pull, and no final decay at weight_decay 0): on two cores the loop is close enough to compute
// bound that every vector op shows in the step time.
// The counter_rng bits of W consecutive global element indices starting at gidx (step_args.h).
template <class V>
struct SrBits {
    using I = typename V::IReg;
    static constexpr int W = V::kWidth;
    static inline I lowbias32(I x) {
        x = V::ixor(x, V::template isrl<16>(x));
        x = V::imul(x, V::iset1(ftk::kLowbias32Mul1));
        x = V::ixor(x, V::template isrl<15>(x));
        x = V::imul(x, V::iset1(ftk::kLowbias32Mul2));
        return V::ixor(x, V::template isrl<16>(x));
    }
    static inline I at(uint32_t key, int64_t gidx) {
        const uint32_t lo = static_cast<uint32_t>(gidx);
        I lo_v, hi_v;
        if (lo <= 0xFFFFFFFFu - static_cast<uint32_t>(W - 1)) {   // the high word is the same in every lane
            lo_v = V::iadd(V::iset1(lo), V::iota());
            hi_v = V::iset1(static_cast<uint32_t>(static_cast<uint64_t>(gidx) >> 32));
        } else {
            alignas(64) uint32_t los[W], his[W];
            for (int k = 0; k < W; ++k) {
                const uint64_t x = static_cast<uint64_t>(gidx) + static_cast<uint64_t>(k);
                los[k] = static_cast<uint32_t>(x);
                his[k] = static_cast<uint32_t>(x >> 32);
            }
            lo_v = V::iload(los);
            hi_v = V::iload(his);
        }
        return lowbias32(V::ixor(lowbias32(V::ixor(lo_v, V::iset1(key))), hi_v));
    }
    static void range(uint32_t key, int64_t index_base, int64_t n, uint32_t* out) {
        int64_t i = 0;
        for (; i + W <= n; i += W) V::istore(out + i, at(key, index_base + i));
        if (i < n) {
            alignas(64) uint32_t lanes[W];
            V::istore(lanes, at(key, index_base + i));
            std::memcpy(out + i, lanes, (n - i) * sizeof(uint32_t));
        }
    }
};

// HasImportance: the anchored tensor's pulls are weighted per element by F~ (step_args.h); without
// it no importance is loaded and the pulls' fractions are the coefficients themselves.
template <class V, ftk::ElemType GT, ftk::ElemType AT, bool HasAnchor, bool HasPre, bool HasPostDecay,
          bool Compact = false, bool HasImportance = false>
struct StepProgram {
    using R = typename V::Reg;
    using I = typename V::IReg;
    static constexpr int W = V::kWidth;
    static constexpr bool Weighted = HasAnchor && HasImportance;

    // One exact program for both states, the same bits on every level (and in the torch and Triton
    // paths, optim/torch_step.py and optim/triton_step.py): only correctly rounded IEEE operations,
    // a product then a sum (never fused: every translation unit is built with -ffp-contract=off and
    // no FMA intrinsic is used here), a true division (not a reciprocal estimate) and the IEEE sqrt.
    // The compact state needs it most (its moments are rounded to bf16, so one ulp could become a
    // different bf16 value); the fp32 state stores the same bits as every other implementation too.
    static inline R madd(R a, R b, R c) { return V::add(V::mul(a, b), c); }
    static inline R quotient(R a, R b) { return V::div(a, b); }

    // Applies the program to W elements whose operands are already loaded.
    // e + w * (x - e): moves the accumulated change toward x by w (a lerp on the delta).
    static inline R lerp(R e, R x, R w) { return madd(w, V::sub(x, e), e); }

    // A pull's fraction: the coefficient w, or per element min(w * F~, 1) (step_args.h). min(1, x)
    // returns x where x is a NaN at every level, as torch's and Triton's minimum do.
    static inline R pull_weight(float w, R f) {
        if (Weighted) return V::min(V::set1(1.0f), V::mul(V::set1(w), f));
        return V::set1(w);
    }

    static inline void apply(const ftk::StepCoeffs& c, R& p, R g, R& m, R& v, R a, R f) {
        const R d = HasAnchor ? V::sub(p, a) : V::zero();   // p - a, before this step
        p = V::sub(p, change(c, p, d, g, m, v, f));
    }

    // Updates m and v and returns the step's total change e of p, given d = p - a (and F~ in f).
    static inline R change(const ftk::StepCoeffs& c, R p, R d, R g, R& m, R& v, R f) {
        m = madd(V::set1(c.one_minus_beta1), g, V::mul(V::set1(c.beta1), m));
        v = madd(V::mul(V::set1(c.one_minus_beta2), g), g, V::mul(V::set1(c.beta2), v));
        const R denom = madd(V::sqrt(v), V::set1(c.denom_scale), V::set1(c.eps));
        R e = V::mul(V::set1(c.step_size), quotient(m, denom));   // change of p so far
        if (HasPre) {
            R pre = V::mul(V::set1(c.pre_decay), p);
            if (HasAnchor) pre = lerp(pre, d, pull_weight(c.pre_pull, f));
            e = V::add(e, pre);
        }
        if (HasAnchor) e = lerp(e, d, pull_weight(c.post_pull, f));
        if (HasPostDecay) e = lerp(e, p, V::set1(c.post_decay));
        return e;
    }

    // ---- the compact state (step_args.h) ----------------------------------------------------
    // The top 16 bits of each lane after adding `r`: r = 0x7FFF + lsb rounds to nearest even, r =
    // 16 random bits rounds stochastically (up with probability (dropped bits) / 2^16).
    // A NaN lane (any sign or payload) stores kBf16NanWord's top half instead: the addition would
    // carry a GPU's NaN (0x7FFFFFFF) into the sign (-0.0), or a low payload into infinity.
    static inline void store_rne(uint16_t* dst, R x) {
        const I u = V::bits(x);
        const I rounded = V::iadd(u, V::iadd(V::iset1(0x7FFFu), V::iand(V::template isrl<16>(u), V::iset1(1u))));
        V::store_hi16(dst, V::select_nan(x, V::iset1(kBf16NanWord), rounded));
    }
    static inline void store_sr(uint16_t* dst, R x, I random) {
        const I rounded = V::iadd(V::bits(x), V::template isrl<16>(random));
        V::store_hi16(dst, V::select_nan(x, V::iset1(kBf16NanWord), rounded));
    }

    // One compact step of the W elements at i, whose global index is gidx. DeltaMaster: an
    // anchored parameter's master is delta (param is written as anchor + delta); otherwise param
    // is the master (a parameter without anchor, or one whose fp32 master another library owns,
    // DeepSpeed's partitions) and the pull reads p - a, rounded once. WeightOut (the bf16 weight
    // form, step_args.h): the new weight is stored in bf16 into w16, rounded to nearest even, and
    // a delta master's param is neither read nor written. w16 may be the gradient itself: the
    // gradient is loaded first, so w16 carries no __restrict.
    template <bool DeltaMaster, bool WeightOut>
    static inline void compact_at(const ftk::StepCoeffs& c, uint32_t key, float* __restrict param, const void* grad,
                                  uint16_t* __restrict m16, uint16_t* __restrict v16, float* __restrict delta,
                                  const void* anchor, const uint16_t* __restrict imp, uint16_t* w16, int64_t i,
                                  int64_t gidx) {
        const R g = load_typed(grad, i, GT);
        const R f = Weighted ? V::load_bf16(imp + i) : V::zero();
        R m = V::load_bf16(m16 + i), v = V::load_bf16(v16 + i);
        R theta;
        if (HasAnchor && DeltaMaster) {
            const R a = load_typed(anchor, i, AT);
            R d = V::load(delta + i);   // theta - theta*, the master: the pull reads it exactly
            d = V::sub(d, change(c, V::add(a, d), d, g, m, v, f));
            V::store(delta + i, d);
            theta = V::add(a, d);
            if (!WeightOut) V::store(param + i, theta);
        } else if (HasAnchor) {
            const R p = V::load(param + i);
            theta = V::sub(p, change(c, p, V::sub(p, load_typed(anchor, i, AT)), g, m, v, f));
            V::store(param + i, theta);
        } else {
            const R p = V::load(param + i);
            theta = V::sub(p, change(c, p, V::zero(), g, m, v, f));
            V::store(param + i, theta);
        }
        if (WeightOut) store_rne(w16 + i, theta);
        store_rne(m16 + i, m);
        store_sr(v16 + i, v, SrBits<V>::at(key, gidx));
    }

    static void run_compact(const ftk::StepArgs& s, int64_t begin, int64_t end) {
        const bool delta_master = !(HasAnchor && s.delta == nullptr);
        if (s.weight16 != nullptr) {
            if (delta_master) run_compact_as<true, true>(s, begin, end);
            else              run_compact_as<false, true>(s, begin, end);
        } else {
            if (delta_master) run_compact_as<true, false>(s, begin, end);
            else              run_compact_as<false, false>(s, begin, end);
        }
    }

    template <bool DeltaMaster, bool WeightOut>
    static void run_compact_as(const ftk::StepArgs& s, int64_t begin, int64_t end) {
        constexpr bool HasDelta = HasAnchor && DeltaMaster;
        // A delta master in the bf16 weight form has no fp32 param (s.param may be null).
        constexpr bool HasParam = !(HasDelta && WeightOut);
        const ftk::StepCoeffs c = s.c;
        const uint32_t key = s.sr_key;
        const int64_t base = s.index_base;
        float* __restrict param = s.param;
        uint16_t* __restrict m16 = reinterpret_cast<uint16_t*>(s.exp_avg);
        uint16_t* __restrict v16 = reinterpret_cast<uint16_t*>(s.exp_avg_sq);
        float* __restrict delta = s.delta;
        uint16_t* w16 = s.weight16;
        const void* grad = s.grad;
        const void* anchor = s.anchor;
        const uint16_t* __restrict imp = s.importance;
        int64_t i = begin;
        for (; i + W <= end; i += W) {
            if (i % kLineElems == 0) {
                if (HasParam) V::prefetch(param + i + kPrefetchElems);
                V::prefetch(m16 + i + kPrefetchElems);
                V::prefetch(v16 + i + kPrefetchElems);
                prefetch_typed(grad, i + kPrefetchElems, GT);
                if (HasDelta) V::prefetch(delta + i + kPrefetchElems);
                if (HasAnchor) prefetch_typed(anchor, i + kPrefetchElems, AT);
                if (Weighted) V::prefetch(imp + i + kPrefetchElems);
            }
            compact_at<DeltaMaster, WeightOut>(c, key, param, grad, m16, v16, delta, anchor, imp, w16, i, base + i);
        }
        const int64_t tail = end - i;
        if (tail == 0) return;
        // Tail: the same vector code on zero-padded copies (bit-identical to the body's arithmetic).
        // Every input is copied before any output is written back (w16 may be the gradient).
        alignas(64) float pb[W] = {}, db[W] = {}, gb[W] = {}, ab[W] = {};
        alignas(64) uint16_t mb[W] = {}, vb[W] = {}, wb[W] = {}, fb[W] = {};
        const size_t gsize = GT == ftk::ElemType::BF16 ? 2 : 4, asize = AT == ftk::ElemType::BF16 ? 2 : 4;
        if (HasParam) std::memcpy(pb, param + i, tail * sizeof(float));
        std::memcpy(mb, m16 + i, tail * sizeof(uint16_t));
        std::memcpy(vb, v16 + i, tail * sizeof(uint16_t));
        std::memcpy(gb, static_cast<const char*>(grad) + i * gsize, tail * gsize);
        if (HasDelta) std::memcpy(db, delta + i, tail * sizeof(float));
        if (HasAnchor) std::memcpy(ab, static_cast<const char*>(anchor) + i * asize, tail * asize);
        if (Weighted) std::memcpy(fb, imp + i, tail * sizeof(uint16_t));
        compact_at<DeltaMaster, WeightOut>(c, key, pb, gb, mb, vb, db, ab, fb, wb, 0, base + i);
        if (HasParam) std::memcpy(param + i, pb, tail * sizeof(float));
        std::memcpy(m16 + i, mb, tail * sizeof(uint16_t));
        std::memcpy(v16 + i, vb, tail * sizeof(uint16_t));
        if (HasDelta) std::memcpy(delta + i, db, tail * sizeof(float));
        if (WeightOut) std::memcpy(w16 + i, wb, tail * sizeof(uint16_t));
    }

    // Undoes apply() (see step_args.h): p first, from the stepped m and v, then m and v.
    static inline void apply_inverse(const ftk::StepCoeffs& c, float inv_keep, R& p, R g, R& m, R& v, R a, R f) {
        const R denom = madd(V::sqrt(v), V::set1(c.denom_scale), V::set1(c.eps));
        R e = V::mul(V::set1(c.step_size), quotient(m, denom));   // the forward's Adam term, bit for bit
        // The rest of the forward's change at p = 0 (d = -a): the constant B of p' = (1 - A) p - B.
        const R d0 = HasAnchor ? V::sub(V::zero(), a) : V::zero();
        const R w_pre = pull_weight(c.pre_pull, f), w_post = pull_weight(c.post_pull, f);
        if (HasPre && HasAnchor) e = V::add(e, V::mul(w_pre, d0));
        if (HasAnchor) e = lerp(e, d0, w_post);
        if (HasPostDecay) e = V::mul(V::set1(1.0f - c.post_decay), e);
        R keep = V::set1(inv_keep);
        if (Weighted) {   // inv_keep holds the decays' part; the pulls' is per element (step_args.h)
            const R one = V::set1(1.0f);
            R kept = V::sub(one, w_post);
            if (HasPre) kept = V::mul(V::sub(one, w_pre), kept);
            keep = V::div(keep, kept);
        }
        p = V::mul(V::add(p, e), keep);
        // The gradient terms are rounded before they are subtracted (no fused multiply-add): from a
        // zero moment (a first step) the forward's m' is exactly that rounded term, so the old
        // moment comes back exactly 0, whatever the forward fused.
        m = c.beta1 > 0.0f ? V::div(V::sub(m, V::mul(V::set1(c.one_minus_beta1), g)), V::set1(c.beta1)) : V::zero();
        v = c.beta2 > 0.0f
                ? V::max(V::div(V::sub(v, V::mul(V::mul(V::set1(c.one_minus_beta2), g), g)), V::set1(c.beta2)),
                         V::zero())
                : V::zero();
    }

    // Elements per cache line of fp32, the unit the prefetches below advance by.
    static constexpr int kLineElems = 16;
    // Elements per loop iteration: 32, two cache lines of each fp32 stream (2 vectors at AVX-512,
    // 4 at AVX2). One vector per iteration reloaded the pointers from s after every store, tested
    // `inverse` inside the loop and, at AVX2, prefetched every line twice: about 45 instructions per
    // 16 elements at AVX-512 against 31 now, and in L2 1.4-1.8x the time of DeepSpeedCPUAdam's
    // loop against 1.07-1.18x now (docs/benchmarks.md, issue 27 part 0).
    static constexpr int kStride = W >= 32 ? W : 32;
    // Prefetch distance, 4 KiB ahead in fp32: eight streams per thread are more than the hardware
    // prefetchers kept far enough ahead of on the Intel host the prefetch was added on (1.15x ->
    // 1.06-1.14x DeepSpeedCPUAdam's time). On the AMD host of issue 27, distances of 0.5-16 KiB,
    // L2-only and non-temporal hints, and no prefetch at all measured alike at 50M.
    static constexpr int64_t kPrefetchElems = 1024;

    static inline void prefetch_typed(const void* base, int64_t i, ftk::ElemType t) {
        if (t == ftk::ElemType::BF16) V::prefetch(static_cast<const uint16_t*>(base) + i);
        else V::prefetch(static_cast<const float*>(base) + i);
    }

    static inline R load_typed(const void* base, int64_t i, ftk::ElemType t) {
        return t == ftk::ElemType::BF16 ? V::load_bf16(static_cast<const uint16_t*>(base) + i)
                                        : V::load(static_cast<const float*>(base) + i);
    }

    // Loads, steps and stores the W elements at i.
    template <bool Inverse>
    static inline void step_at(const ftk::StepCoeffs& c, float inv_keep, float* __restrict param,
                               const void* grad, float* __restrict exp_avg, float* __restrict exp_avg_sq,
                               const void* anchor, const uint16_t* __restrict imp, int64_t i) {
        R p = V::load(param + i), m = V::load(exp_avg + i), v = V::load(exp_avg_sq + i);
        R g = load_typed(grad, i, GT);
        R a = HasAnchor ? load_typed(anchor, i, AT) : V::zero();
        R f = Weighted ? V::load_bf16(imp + i) : V::zero();
        if (Inverse) apply_inverse(c, inv_keep, p, g, m, v, a, f);
        else apply(c, p, g, m, v, a, f);
        V::store(param + i, p);
        V::store(exp_avg + i, m);
        V::store(exp_avg_sq + i, v);
    }

    // The whole vectors of [begin, end); returns where the tail starts. Inverse is a template
    // argument and the pointers are locals, so the loop holds no branch and no reload of s (its
    // fields could alias the stored floats as far as the compiler knows).
    template <bool Inverse>
    static int64_t run_vectors(const ftk::StepArgs& s, int64_t begin, int64_t end) {
        const ftk::StepCoeffs c = s.c;
        const float inv_keep = s.inv_keep;
        float* __restrict param = s.param;
        float* __restrict exp_avg = s.exp_avg;
        float* __restrict exp_avg_sq = s.exp_avg_sq;
        const void* grad = s.grad;
        const void* anchor = s.anchor;
        const uint16_t* __restrict imp = s.importance;
        int64_t i = begin;
        for (; i + kStride <= end; i += kStride) {
            // One prefetch per cache line of each stream (past the end is harmless).
            for (int k = 0; k < kStride; k += kLineElems) {
                V::prefetch(param + i + k + kPrefetchElems);
                V::prefetch(exp_avg + i + k + kPrefetchElems);
                V::prefetch(exp_avg_sq + i + k + kPrefetchElems);
                prefetch_typed(grad, i + k + kPrefetchElems, GT);
                if (HasAnchor) prefetch_typed(anchor, i + k + kPrefetchElems, AT);
                if (Weighted && k % (2 * kLineElems) == 0) V::prefetch(imp + i + k + kPrefetchElems);  // bf16
            }
            for (int u = 0; u < kStride; u += W)
                step_at<Inverse>(c, inv_keep, param, grad, exp_avg, exp_avg_sq, anchor, imp, i + u);
        }
        for (; i + W <= end; i += W)
            step_at<Inverse>(c, inv_keep, param, grad, exp_avg, exp_avg_sq, anchor, imp, i);
        return i;
    }

    static void apply_kind(const ftk::StepCoeffs& c, bool inverse, float inv_keep, R& p, R g, R& m, R& v, R a,
                           R f) {
        if (inverse) apply_inverse(c, inv_keep, p, g, m, v, a, f);
        else apply(c, p, g, m, v, a, f);
    }

    static void run(const ftk::StepArgs& s, int64_t begin, int64_t end) {
        if constexpr (Compact) {
            run_compact(s, begin, end);   // the binding refuses an inverse of a compact step
        } else {
            run_full(s, begin, end);
        }
    }

    static void run_full(const ftk::StepArgs& s, int64_t begin, int64_t end) {
        const ftk::StepCoeffs c = s.c;
        const bool inverse = s.inverse;
        const float inv_keep = s.inv_keep;
        const int64_t i = inverse ? run_vectors<true>(s, begin, end) : run_vectors<false>(s, begin, end);
        const int64_t tail = end - i;
        if (tail == 0) return;
        // Tail: stage the last < W elements in zero-padded buffers and run the same vector code,
        // so tails get bit-identical arithmetic to the body (zeros are safe: sqrt(0) + eps > 0).
        alignas(64) float pb[W] = {}, mb[W] = {}, vb[W] = {}, gb[W] = {}, ab[W] = {};
        alignas(64) uint16_t fb[W] = {};
        std::memcpy(pb, s.param + i, tail * sizeof(float));
        std::memcpy(mb, s.exp_avg + i, tail * sizeof(float));
        std::memcpy(vb, s.exp_avg_sq + i, tail * sizeof(float));
        widen(s.grad, GT, i, tail, gb);
        if (HasAnchor) widen(s.anchor, AT, i, tail, ab);
        if (Weighted) std::memcpy(fb, s.importance + i, tail * sizeof(uint16_t));
        R p = V::load(pb), m = V::load(mb), v = V::load(vb), g = V::load(gb), a = V::load(ab);
        const R f = Weighted ? V::load_bf16(fb) : V::zero();
        apply_kind(c, inverse, inv_keep, p, g, m, v, a, f);
        V::store(pb, p);
        V::store(mb, m);
        V::store(vb, v);
        std::memcpy(s.param + i, pb, tail * sizeof(float));
        std::memcpy(s.exp_avg + i, mb, tail * sizeof(float));
        std::memcpy(s.exp_avg_sq + i, vb, tail * sizeof(float));
    }

    // Copies `count` elements starting at `offset` into fp32 (bf16 is the top half of an fp32).
    static void widen(const void* base, ftk::ElemType t, int64_t offset, int64_t count, float* out) {
        if (t == ftk::ElemType::F32) {
            std::memcpy(out, static_cast<const float*>(base) + offset, count * sizeof(float));
            return;
        }
        const uint16_t* src = static_cast<const uint16_t*>(base) + offset;
        for (int64_t k = 0; k < count; ++k) {
            uint32_t bits = static_cast<uint32_t>(src[k]) << 16;
            std::memcpy(out + k, &bits, sizeof(bits));
        }
    }
};

// Picks the template instance for the runtime dtypes, anchor and importance presence and the stages in use.
template <class V, ftk::ElemType GT, ftk::ElemType AT, bool HasAnchor, bool Compact, bool Imp>
void dispatch_stages_of(const ftk::StepArgs& s, int64_t begin, int64_t end) {
    const bool pre = s.c.pre_decay != 0.0f || (HasAnchor && s.c.pre_pull != 0.0f);
    const bool post_decay = s.c.post_decay != 0.0f;
    if (pre && post_decay)  StepProgram<V, GT, AT, HasAnchor, true, true, Compact, Imp>::run(s, begin, end);
    else if (pre)           StepProgram<V, GT, AT, HasAnchor, true, false, Compact, Imp>::run(s, begin, end);
    else if (post_decay)    StepProgram<V, GT, AT, HasAnchor, false, true, Compact, Imp>::run(s, begin, end);
    else                    StepProgram<V, GT, AT, HasAnchor, false, false, Compact, Imp>::run(s, begin, end);
}

template <class V, ftk::ElemType GT, ftk::ElemType AT, bool HasAnchor, bool Imp = false>
void dispatch_stages(const ftk::StepArgs& s, int64_t begin, int64_t end) {
    if (s.compact) dispatch_stages_of<V, GT, AT, HasAnchor, true, Imp>(s, begin, end);
    else           dispatch_stages_of<V, GT, AT, HasAnchor, false, Imp>(s, begin, end);
}

// The anchored instances, with or without the per-element importance.
template <class V, ftk::ElemType GT, ftk::ElemType AT>
void dispatch_anchored(const ftk::StepArgs& s, int64_t begin, int64_t end) {
    if (s.importance != nullptr) dispatch_stages<V, GT, AT, true, true>(s, begin, end);
    else                         dispatch_stages<V, GT, AT, true, false>(s, begin, end);
}

// True when every element of grad[begin, end) is finite: x * 0 is 0 for finite x and NaN for
// NaN or infinity, so one accumulated sum says it (denormals, flushed or not, give 0 too).
template <class V>
bool grad_finite(const void* grad, ftk::ElemType t, int64_t begin, int64_t end) {
    using R = typename V::Reg;
    constexpr int W = V::kWidth;
    R acc = V::zero();
    const R zero = V::zero();
    int64_t i = begin;
    for (; i + W <= end; i += W) {
        const R g = t == ftk::ElemType::BF16 ? V::load_bf16(static_cast<const uint16_t*>(grad) + i)
                                             : V::load(static_cast<const float*>(grad) + i);
        acc = V::add(acc, V::mul(g, zero));
    }
    alignas(64) float lanes[W];
    V::store(lanes, acc);
    float total = 0.0f;
    for (int k = 0; k < W; ++k) total += lanes[k];
    for (; i < end; ++i) {
        float x;
        if (t == ftk::ElemType::BF16) {
            uint32_t bits = static_cast<uint32_t>(static_cast<const uint16_t*>(grad)[i]) << 16;
            std::memcpy(&x, &bits, sizeof(x));
        } else {
            x = static_cast<const float*>(grad)[i];
        }
        total += x * 0.0f;
    }
    return total == 0.0f;
}

template <class V>
void dispatch_step(const ftk::StepArgs& s, int64_t begin, int64_t end) {
    using ftk::ElemType;
    const bool g16 = s.grad_type == ElemType::BF16;
    if (s.anchor == nullptr) {
        if (g16) dispatch_stages<V, ElemType::BF16, ElemType::F32, false>(s, begin, end);
        else     dispatch_stages<V, ElemType::F32, ElemType::F32, false>(s, begin, end);
        return;
    }
    const bool a16 = s.anchor_type == ElemType::BF16;
    if (g16 && a16)  dispatch_anchored<V, ElemType::BF16, ElemType::BF16>(s, begin, end);
    else if (g16)    dispatch_anchored<V, ElemType::BF16, ElemType::F32>(s, begin, end);
    else if (a16)    dispatch_anchored<V, ElemType::F32, ElemType::BF16>(s, begin, end);
    else             dispatch_anchored<V, ElemType::F32, ElemType::F32>(s, begin, end);
}

}  // namespace
