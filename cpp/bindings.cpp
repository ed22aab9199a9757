// pybind11 module ft_framework._cpu_kernel: runtime ISA dispatch and OpenMP threading around the
// per-ISA step ranges. Tensors arrive through the buffer protocol (1-D views that share the tensors'
// memory; bf16 as 16-bit integers, which the buffer protocol has no type for) and the step's
// coefficients as one Coefficients object, so no torch headers are needed here. The Python wrapper
// (ft_framework/optim/cpu.py) checks device, dtype and contiguity first and says what to change;
// the checks here keep a direct caller from writing out of bounds. The one exception is the
// private _fused_step_many, which takes addresses (see there).
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <omp.h>
#include <xmmintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "step_args.h"

namespace py = pybind11;

namespace {

enum class Level : int { Scalar = 0, Avx2 = 1, Avx512 = 2 };
const char* kLevelNames[] = {"scalar", "avx2", "avx512"};

Level best_supported_level() {
    __builtin_cpu_init();
    // libgcc's checks include the OS's XCR0 state, so a kernel that disabled AVX-512 is honoured.
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma")) return Level::Avx512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Level::Avx2;
    return Level::Scalar;
}

Level g_level = best_supported_level();

std::vector<std::string> supported_levels() {
    std::vector<std::string> out;
    for (int l = 0; l <= static_cast<int>(best_supported_level()); ++l) out.emplace_back(kLevelNames[l]);
    return out;
}

void set_level(const std::string& name) {
    const auto levels = supported_levels();
    for (size_t l = 0; l < levels.size(); ++l) {
        if (levels[l] == name) { g_level = static_cast<Level>(l); return; }
    }
    std::string valid;
    for (const auto& l : levels) valid += (valid.empty() ? "" : ", ") + l;
    throw std::invalid_argument("SIMD level '" + name + "' is not available on this CPU; choose one of: " + valid);
}

using RangeFn = void (*)(const ftk::StepArgs&, int64_t, int64_t);

RangeFn range_fn(Level level) {
    switch (level) {
        case Level::Avx512: return ftk::step_range_avx512;
        case Level::Avx2: return ftk::step_range_avx2;
        default: return ftk::step_range_scalar;
    }
}

// Flushes denormals to zero (MXCSR FTZ + DAZ) on this thread for the guard's lifetime. RecAdam's
// Adam term is scaled by lambda(t), which the sigmoid makes as small as e^-100 early in training:
// the products land in fp32 denormals, whose microcode assists made steps 1.2x slower. Values
// below 1.2e-38 are far under the rounding of any parameter they update.
class FlushDenormals {
public:
    FlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | kFtz | kDaz); }
    ~FlushDenormals() { _mm_setcsr(saved_); }
private:
    static constexpr unsigned kFtz = 1u << 15, kDaz = 1u << 6;
    unsigned saved_;
};

// Below this many elements a parallel region costs more than it saves.
constexpr int64_t kMinParallelElems = 1 << 15;
// Thread ranges start on 64-element boundaries so every thread's body runs whole vectors.
constexpr int64_t kChunkAlign = 64;

struct Buffer {
    void* ptr;
    int64_t numel;
    ftk::ElemType type;
};

// A 1-D contiguous buffer of fp32 (or, where allowed, 16-bit bf16 bit patterns).
Buffer as_buffer(const py::buffer& b, const char* role, bool writable, bool allow_bf16) {
    const py::buffer_info info = b.request(writable);
    const std::string name(role);
    if (info.ndim != 1) throw std::invalid_argument(name + " must be a 1-D buffer");
    if (info.shape[0] > 1 && info.strides[0] != info.itemsize)
        throw std::invalid_argument(name + " is not contiguous (the kernel updates memory in place)");
    if (info.itemsize == 4 && info.format == py::format_descriptor<float>::format())
        return {info.ptr, info.shape[0], ftk::ElemType::F32};
    if (allow_bf16 && info.itemsize == 2 && (info.format == "h" || info.format == "H"))
        return {info.ptr, info.shape[0], ftk::ElemType::BF16};
    throw std::invalid_argument(name + " must hold float32" + (allow_bf16 ? " or bfloat16 bits (int16)" : "") +
                                ", got buffer format '" + info.format + "'");
}

using FiniteFn = bool (*)(const void*, ftk::ElemType, int64_t, int64_t);

FiniteFn finite_fn(Level level) {
    switch (level) {
        case Level::Avx512: return ftk::grad_finite_avx512;
        case Level::Avx2: return ftk::grad_finite_avx2;
        default: return ftk::grad_finite_scalar;
    }
}

// 1 / (1 - A), where p' = (1 - A) p - B is the forward step as a function of p (step_args.h).
// A depends only on the coefficients and on which stages the kernel runs; double, rounded once.
// With the per-element importance the pulls' part is the kernel's, per element: this is the
// decays' alone, and `largest_importance` (the tensor's largest F~) says whether some element's
// pull fraction min(w * F~, 1) reached 1 (that element is theta* whatever it was: no undo).
float inverse_keep(const ftk::StepCoeffs& c, bool has_anchor, bool has_importance = false,
                   float largest_importance = 0.0f) {
    double a = 0.0;
    const bool pre = c.pre_decay != 0.0f || (has_anchor && c.pre_pull != 0.0f);
    const bool pulls = has_anchor && !has_importance;
    if (pre) {
        a = c.pre_decay;
        if (pulls) a += c.pre_pull * (1.0 - a);
    }
    if (pulls) a += c.post_pull * (1.0 - a);
    if (c.post_decay != 0.0f) a += c.post_decay * (1.0 - a);
    bool whole = !(1.0 - a > 0.0);
    if (has_anchor && has_importance) {
        const float largest_pull = std::max(pre ? c.pre_pull * largest_importance : 0.0f,
                                            c.post_pull * largest_importance);  // one fp32 product each
        whole = whole || !(largest_pull < 1.0f);
    }
    if (whole)
        throw std::invalid_argument("this step removes all of p (pulls and decays sum to >= 1, or an importance-"
                                    "weighted pull reached theta*): it cannot be undone");
    return static_cast<float>(1.0 / (1.0 - a));
}

// The largest of n bf16 values (a NaN counts as infinitely large: its step cannot be undone either).
float largest_bf16(const uint16_t* bits, int64_t n) {
    float best = 0.0f;
    for (int64_t k = 0; k < n; ++k) {
        const uint32_t word = static_cast<uint32_t>(bits[k]) << 16;
        float x;
        std::memcpy(&x, &word, sizeof(x));
        if (x != x) return std::numeric_limits<float>::infinity();
        best = std::max(best, x);
    }
    return best;
}

// Sets the per-element importance F~ of s (bf16 bits, the anchored tensor's; step_args.h).
void set_importance(ftk::StepArgs& s, const std::optional<py::buffer>& importance, int64_t numel) {
    if (!importance) return;
    if (s.anchor == nullptr)
        throw std::invalid_argument("the importance weighs the pull toward theta*: it needs its anchor");
    const Buffer f = as_buffer(*importance, "importance", false, true);
    if (f.type != ftk::ElemType::BF16) throw std::invalid_argument("the importance must hold bfloat16 bits (int16)");
    if (f.numel != numel)
        throw std::invalid_argument("importance must have the parameter's " + std::to_string(numel) + " elements");
    s.importance = static_cast<const uint16_t*>(f.ptr);
}

// Checks the buffers (GIL held) and describes the step over them. `bf16_moments`: the compact
// state's exp_avg and exp_avg_sq, which must then be bfloat16 (fp32 otherwise).
ftk::StepArgs make_args(const py::buffer& param, const py::buffer& grad, const py::buffer& exp_avg,
                        const py::buffer& exp_avg_sq, const std::optional<py::buffer>& anchor,
                        const ftk::StepCoeffs& coeffs, int64_t* numel_out, bool bf16_moments = false) {
    const Buffer p = as_buffer(param, "param", true, false);
    const Buffer g = as_buffer(grad, "grad", false, true);
    const Buffer m = as_buffer(exp_avg, "exp_avg", true, bf16_moments);
    const Buffer v = as_buffer(exp_avg_sq, "exp_avg_sq", true, bf16_moments);
    if (bf16_moments && (m.type != ftk::ElemType::BF16 || v.type != ftk::ElemType::BF16))
        throw std::invalid_argument("the compact step keeps exp_avg and exp_avg_sq in bfloat16 (int16 bits)");
    const Buffer a = anchor ? as_buffer(*anchor, "anchor", false, true) : Buffer{nullptr, p.numel, ftk::ElemType::F32};
    const int64_t numel = p.numel;
    if (g.numel != numel || m.numel != numel || v.numel != numel || a.numel != numel)
        throw std::invalid_argument("grad, exp_avg, exp_avg_sq and anchor must have the parameter's " +
                                    std::to_string(numel) + " elements");
    ftk::StepArgs s;
    s.param = static_cast<float*>(p.ptr);
    s.grad = g.ptr;
    s.exp_avg = static_cast<float*>(m.ptr);
    s.exp_avg_sq = static_cast<float*>(v.ptr);
    s.anchor = a.ptr;
    s.grad_type = g.type;
    s.anchor_type = a.type;
    s.c = coeffs;
    *numel_out = numel;
    return s;
}

int thread_count(int num_threads, int64_t numel) {
    const int threads = num_threads > 0 ? num_threads : omp_get_max_threads();
    return numel < kMinParallelElems ? 1 : threads;
}

// Element range of thread `tid` of `nth`, starting on a kChunkAlign boundary.
std::pair<int64_t, int64_t> thread_range(int64_t numel, int64_t nth, int64_t tid) {
    int64_t per = (numel + nth - 1) / nth;
    per = (per + kChunkAlign - 1) / kChunkAlign * kChunkAlign;
    const int64_t begin = std::min(numel, tid * per);
    return {begin, std::min(numel, begin + per)};
}

// Runs the step (or its inverse) described by s over [0, numel); the GIL must be released.
void run_step(const ftk::StepArgs& s, int64_t numel, int num_threads) {
    if (numel == 0) return;
    const RangeFn fn = range_fn(g_level);
    const int threads = thread_count(num_threads, numel);
    if (threads == 1) {
        FlushDenormals ftz;
        fn(s, 0, numel);
        return;
    }
#pragma omp parallel num_threads(threads)
    {
        FlushDenormals ftz;  // MXCSR is per thread
        const auto [begin, end] = thread_range(numel, omp_get_num_threads(), omp_get_thread_num());
        if (begin < end) fn(s, begin, end);
    }
}

// Whether every gradient element is finite; the GIL must be released.
bool all_finite(const ftk::StepArgs& s, int64_t numel, int num_threads) {
    const FiniteFn fn = finite_fn(g_level);
    const int threads = thread_count(num_threads, numel);
    if (threads == 1) return fn(s.grad, s.grad_type, 0, numel);
    int bad = 0;
#pragma omp parallel num_threads(threads) reduction(| : bad)
    {
        const auto [begin, end] = thread_range(numel, omp_get_num_threads(), omp_get_thread_num());
        if (begin < end && !fn(s.grad, s.grad_type, begin, end)) bad = 1;
    }
    return bad == 0;
}

void fused_step(const py::buffer& param, const py::buffer& grad, const py::buffer& exp_avg,
                const py::buffer& exp_avg_sq, const std::optional<py::buffer>& anchor,
                const ftk::StepCoeffs& coeffs, int num_threads, const std::optional<py::buffer>& importance) {
    int64_t numel = 0;
    ftk::StepArgs s = make_args(param, grad, exp_avg, exp_avg_sq, anchor, coeffs, &numel);
    set_importance(s, importance, numel);
    py::gil_scoped_release nogil;  // the buffers' memory stays alive: the caller holds the arrays
    run_step(s, numel, num_threads);
}

bool guarded_step(const py::buffer& param, const py::buffer& grad, const py::buffer& exp_avg,
                  const py::buffer& exp_avg_sq, const std::optional<py::buffer>& anchor,
                  const ftk::StepCoeffs& coeffs, int num_threads, const std::optional<py::buffer>& importance) {
    int64_t numel = 0;
    ftk::StepArgs s = make_args(param, grad, exp_avg, exp_avg_sq, anchor, coeffs, &numel);
    set_importance(s, importance, numel);
    py::gil_scoped_release nogil;
    if (!all_finite(s, numel, num_threads)) return false;
    run_step(s, numel, num_threads);
    return true;
}

void fused_inverse(const py::buffer& param, const py::buffer& grad, const py::buffer& exp_avg,
                   const py::buffer& exp_avg_sq, const std::optional<py::buffer>& anchor,
                   const ftk::StepCoeffs& coeffs, int num_threads, const std::optional<py::buffer>& importance) {
    int64_t numel = 0;
    ftk::StepArgs s = make_args(param, grad, exp_avg, exp_avg_sq, anchor, coeffs, &numel);
    set_importance(s, importance, numel);
    s.inverse = true;
    if (s.importance == nullptr) {
        s.inv_keep = inverse_keep(coeffs, s.anchor != nullptr);
    } else {
        float largest = 0.0f;
        {
            py::gil_scoped_release nogil;
            largest = largest_bf16(s.importance, numel);
        }
        s.inv_keep = inverse_keep(coeffs, true, true, largest);
    }
    py::gil_scoped_release nogil;
    run_step(s, numel, num_threads);
}

// One step of the compact state (step_args.h): bf16 moments; with an anchor and a delta, the fp32
// delta is the master (param is written as anchor + delta); with an anchor alone, param is the
// master. sr_key and index_base key the stochastic rounding.
void fused_step_compact(const py::buffer& param, const py::buffer& grad, const py::buffer& exp_avg,
                        const py::buffer& exp_avg_sq, const std::optional<py::buffer>& delta,
                        const std::optional<py::buffer>& anchor, const ftk::StepCoeffs& coeffs, uint32_t sr_key,
                        int64_t index_base, int num_threads, const std::optional<py::buffer>& importance) {
    if (delta.has_value() && !anchor.has_value())
        throw std::invalid_argument("the compact step's delta is theta - theta*: it needs its anchor");
    if (index_base < 0) throw std::invalid_argument("index_base must be >= 0");
    int64_t numel = 0;
    ftk::StepArgs s = make_args(param, grad, exp_avg, exp_avg_sq, anchor, coeffs, &numel, true);
    const Buffer d = delta ? as_buffer(*delta, "delta", true, false) : Buffer{nullptr, numel, ftk::ElemType::F32};
    if (d.numel != numel)
        throw std::invalid_argument("delta must have the parameter's " + std::to_string(numel) + " elements");
    s.compact = true;
    s.delta = static_cast<float*>(d.ptr);
    s.sr_key = sr_key;
    s.index_base = index_base;
    set_importance(s, importance, numel);
    py::gil_scoped_release nogil;
    run_step(s, numel, num_threads);
}

// fused_step_compact over many tensors given by address, in one call that releases the GIL once (as
// fused_step_many); private to ft_framework.optim.cpu.fused_step_compact_many and
// fused_step_compact_bf16_many, which check every tensor first. anchors[i] 0: a parameter without
// theta*; deltas[i] 0 with an anchor: param is the master; weights[i] non-zero: the bf16 weight form
// (step_args.h), where a delta master has no param (params[i] 0).
void fused_step_compact_many(const std::vector<uintptr_t>& params, const std::vector<uintptr_t>& grads,
                             const std::vector<uintptr_t>& exp_avgs, const std::vector<uintptr_t>& exp_avg_sqs,
                             const std::vector<uintptr_t>& deltas, const std::vector<uintptr_t>& anchors,
                             const std::vector<int64_t>& numels, const std::vector<bool>& grad_bf16,
                             const std::vector<bool>& anchor_bf16, const std::vector<int64_t>& index_bases,
                             const std::vector<uintptr_t>& weights, const ftk::StepCoeffs& coeffs, uint32_t sr_key,
                             int num_threads, const std::vector<uintptr_t>& importances) {
    const size_t n = params.size();
    if (grads.size() != n || exp_avgs.size() != n || exp_avg_sqs.size() != n || deltas.size() != n ||
        anchors.size() != n || numels.size() != n || grad_bf16.size() != n || anchor_bf16.size() != n ||
        index_bases.size() != n || weights.size() != n || (!importances.empty() && importances.size() != n))
        throw std::invalid_argument("fused_step_compact_many: every list must have one entry per tensor (importances: "
                                    "one per tensor, or none)");
    std::vector<ftk::StepArgs> args(n);
    for (size_t i = 0; i < n; ++i) {
        // The one master without an fp32 param: a delta master of the bf16 weight form.
        const bool param_free = deltas[i] != 0 && weights[i] != 0;
        if (numels[i] < 0 || index_bases[i] < 0 || (deltas[i] != 0 && anchors[i] == 0) ||
            (numels[i] > 0 && ((!params[i] && !param_free) || (params[i] && param_free) || !grads[i] ||
                               !exp_avgs[i] || !exp_avg_sqs[i])))
            throw std::invalid_argument("fused_step_compact_many: a null address, a negative size or index, a "
                                        "delta without its anchor, or a param beside a delta in the bf16 weight form");
        if (!importances.empty() && importances[i] != 0 && anchors[i] == 0)
            throw std::invalid_argument("fused_step_compact_many: an importance without its anchor");
        ftk::StepArgs& s = args[i];
        s.param = reinterpret_cast<float*>(params[i]);
        s.grad = reinterpret_cast<const void*>(grads[i]);
        s.exp_avg = reinterpret_cast<float*>(exp_avgs[i]);   // bf16 bits
        s.exp_avg_sq = reinterpret_cast<float*>(exp_avg_sqs[i]);
        s.anchor = reinterpret_cast<const void*>(anchors[i]);
        s.grad_type = grad_bf16[i] ? ftk::ElemType::BF16 : ftk::ElemType::F32;
        s.anchor_type = anchor_bf16[i] ? ftk::ElemType::BF16 : ftk::ElemType::F32;
        s.c = coeffs;
        s.compact = true;
        s.delta = reinterpret_cast<float*>(deltas[i]);
        s.sr_key = sr_key;
        s.index_base = index_bases[i];
        s.weight16 = reinterpret_cast<uint16_t*>(weights[i]);   // 0: the fp32 param form
        if (!importances.empty()) s.importance = reinterpret_cast<const uint16_t*>(importances[i]);  // 0: none
    }
    py::gil_scoped_release nogil;
    for (size_t i = 0; i < n; ++i) run_step(args[i], numels[i], num_threads);
}

using BitsFn = void (*)(uint32_t, int64_t, int64_t, uint32_t*);

// The stochastic rounding's 32 random bits of elements [index_base, index_base + n) at the current
// SIMD level, as a list (tests compare them with counter_rng.random_bits).
std::vector<uint32_t> sr_bits(uint32_t key, int64_t index_base, int64_t n) {
    if (n < 0 || index_base < 0) throw std::invalid_argument("sr_bits: n and index_base must be >= 0");
    const BitsFn fn = g_level == Level::Avx512 ? ftk::sr_bits_avx512
                      : g_level == Level::Avx2 ? ftk::sr_bits_avx2 : ftk::sr_bits_scalar;
    std::vector<uint32_t> out(static_cast<size_t>(n));
    fn(key, index_base, n, out.data());
    return out;
}

// Many tensors' steps with one set of coefficients, in one call that releases the GIL once. A
// bucket of hundreds of small tensors (biases, LayerNorms) through fused_step paid a Python call,
// five buffer requests and a GIL hand-off per tensor: more than their arithmetic, and the GIL
// then stalled the thread running backward. Each tensor arrives as the addresses of its five
// arrays and its element count: the Python wrapper (cpu.fused_step_many) checks every tensor's
// device, dtype, contiguity and sizes first and holds the tensors for the call, which is why this
// entry point is private to it (a direct caller gets no bounds check).
void fused_step_many(const std::vector<uintptr_t>& params, const std::vector<uintptr_t>& grads,
                     const std::vector<uintptr_t>& exp_avgs, const std::vector<uintptr_t>& exp_avg_sqs,
                     const std::vector<uintptr_t>& anchors, const std::vector<int64_t>& numels,
                     const std::vector<bool>& grad_bf16, const std::vector<bool>& anchor_bf16,
                     const ftk::StepCoeffs& coeffs, int num_threads, const std::vector<uintptr_t>& importances) {
    const size_t n = params.size();
    if (grads.size() != n || exp_avgs.size() != n || exp_avg_sqs.size() != n || anchors.size() != n ||
        numels.size() != n || grad_bf16.size() != n || anchor_bf16.size() != n ||
        (!importances.empty() && importances.size() != n))
        throw std::invalid_argument("fused_step_many: every list must have one entry per tensor (importances: one "
                                    "per tensor, or none)");
    std::vector<ftk::StepArgs> args(n);
    for (size_t i = 0; i < n; ++i) {
        if (numels[i] < 0 || (numels[i] > 0 && (!params[i] || !grads[i] || !exp_avgs[i] || !exp_avg_sqs[i])))
            throw std::invalid_argument("fused_step_many: a null address or a negative size");
        if (!importances.empty() && importances[i] != 0 && anchors[i] == 0)
            throw std::invalid_argument("fused_step_many: an importance without its anchor");
        ftk::StepArgs& s = args[i];
        s.param = reinterpret_cast<float*>(params[i]);
        s.grad = reinterpret_cast<const void*>(grads[i]);
        s.exp_avg = reinterpret_cast<float*>(exp_avgs[i]);
        s.exp_avg_sq = reinterpret_cast<float*>(exp_avg_sqs[i]);
        s.anchor = reinterpret_cast<const void*>(anchors[i]);  // 0: no anchor terms
        s.grad_type = grad_bf16[i] ? ftk::ElemType::BF16 : ftk::ElemType::F32;
        s.anchor_type = anchor_bf16[i] ? ftk::ElemType::BF16 : ftk::ElemType::F32;
        s.c = coeffs;
        if (!importances.empty()) s.importance = reinterpret_cast<const uint16_t*>(importances[i]);  // 0: none
    }
    py::gil_scoped_release nogil;
    for (size_t i = 0; i < n; ++i) run_step(args[i], numels[i], num_threads);
}

}  // namespace

PYBIND11_MODULE(_cpu_kernel, m) {
    m.doc() = "Fused one-pass CPU optimizer step (RecAdam, AdamW, BERTAdam, prior_wd) with runtime SIMD dispatch";
    m.def("supported_levels", &supported_levels,
          "SIMD levels this CPU can run, lowest first (the build always carries all three)");
    m.def("get_level", [] { return std::string(kLevelNames[static_cast<int>(g_level)]); });
    m.def("set_level", &set_level, py::arg("name"));
    m.def("max_threads", [] { return omp_get_max_threads(); });
    py::class_<ftk::StepCoeffs>(m, "Coefficients",
                                "One step's coefficients (cpp/step_args.h); 1 - beta is given rounded once from double")
        .def(py::init<>())
        .def_readwrite("beta1", &ftk::StepCoeffs::beta1)
        .def_readwrite("beta2", &ftk::StepCoeffs::beta2)
        .def_readwrite("eps", &ftk::StepCoeffs::eps)
        .def_readwrite("one_minus_beta1", &ftk::StepCoeffs::one_minus_beta1)
        .def_readwrite("one_minus_beta2", &ftk::StepCoeffs::one_minus_beta2)
        .def_readwrite("denom_scale", &ftk::StepCoeffs::denom_scale)
        .def_readwrite("step_size", &ftk::StepCoeffs::step_size)
        .def_readwrite("pre_decay", &ftk::StepCoeffs::pre_decay)
        .def_readwrite("pre_pull", &ftk::StepCoeffs::pre_pull)
        .def_readwrite("post_pull", &ftk::StepCoeffs::post_pull)
        .def_readwrite("post_decay", &ftk::StepCoeffs::post_decay);
    // The buffers are read before the GIL is released (py::buffer needs it); the step runs without.
    m.def("fused_step",
          [](const py::buffer& param, const py::buffer& grad, const py::buffer& exp_avg, const py::buffer& exp_avg_sq,
             const std::optional<py::buffer>& anchor, const ftk::StepCoeffs& coeffs, int num_threads,
             const std::optional<py::buffer>& importance) {
              fused_step(param, grad, exp_avg, exp_avg_sq, anchor, coeffs, num_threads, importance);
          },
          py::arg("param"), py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("anchor"),
          py::arg("coeffs"), py::arg("num_threads") = 0, py::arg("importance") = py::none(),
          "One fused step in place over 1-D buffers of equal length; anchor=None means none; importance (bf16 "
          "bits, beside an anchor): each pull's fraction min(w * importance, 1) per element.");
    m.def("_fused_step_many", &fused_step_many, py::arg("params"), py::arg("grads"), py::arg("exp_avgs"),
          py::arg("exp_avg_sqs"), py::arg("anchors"), py::arg("numels"), py::arg("grad_bf16"), py::arg("anchor_bf16"),
          py::arg("coeffs"), py::arg("num_threads") = 0, py::arg("importances") = std::vector<uintptr_t>{},
          "fused_step over many tensors given by address (0: no anchor, no importance; importances empty: none); "
          "private to ft_framework.optim.cpu, which checks every tensor first.");
    m.def("fused_step_compact", &fused_step_compact, py::arg("param"), py::arg("grad"), py::arg("exp_avg"),
          py::arg("exp_avg_sq"), py::arg("delta"), py::arg("anchor"), py::arg("coeffs"), py::arg("sr_key"),
          py::arg("index_base"), py::arg("num_threads") = 0, py::arg("importance") = py::none(),
          "One step of the compact state in place (bf16 moments, stochastic rounding of v; with an anchor the fp32 "
          "delta is the master and param is written as anchor + delta, without delta param is the master); no "
          "inverse exists.");
    m.def("_fused_step_compact_many", &fused_step_compact_many, py::arg("params"), py::arg("grads"),
          py::arg("exp_avgs"), py::arg("exp_avg_sqs"), py::arg("deltas"), py::arg("anchors"), py::arg("numels"),
          py::arg("grad_bf16"), py::arg("anchor_bf16"), py::arg("index_bases"), py::arg("weights"), py::arg("coeffs"),
          py::arg("sr_key"), py::arg("num_threads") = 0, py::arg("importances") = std::vector<uintptr_t>{},
          "fused_step_compact over many tensors given by address (weights: 0, or the bf16 weight form's output, "
          "which may be the bf16 gradient); private to ft_framework.optim.cpu, which checks every tensor first.");
    m.def("sr_bits", &sr_bits, py::arg("key"), py::arg("index_base"), py::arg("n"),
          "counter_rng's 32 random bits of n consecutive elements at the current SIMD level");
    m.def("rng_constants", [] { return std::make_pair(ftk::kLowbias32Mul1, ftk::kLowbias32Mul2); },
          "The kernel's copy of counter_rng's lowbias32 multipliers (tested against the Python owner)");
    m.def("guarded_step",
          [](const py::buffer& param, const py::buffer& grad, const py::buffer& exp_avg, const py::buffer& exp_avg_sq,
             const std::optional<py::buffer>& anchor, const ftk::StepCoeffs& coeffs, int num_threads,
             const std::optional<py::buffer>& importance) {
              return guarded_step(param, grad, exp_avg, exp_avg_sq, anchor, coeffs, num_threads, importance);
          },
          py::arg("param"), py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("anchor"),
          py::arg("coeffs"), py::arg("num_threads") = 0, py::arg("importance") = py::none(),
          "fused_step when every gradient element is finite (returns True); else touches nothing, returns False.");
    m.def("fused_inverse",
          [](const py::buffer& param, const py::buffer& grad, const py::buffer& exp_avg, const py::buffer& exp_avg_sq,
             const std::optional<py::buffer>& anchor, const ftk::StepCoeffs& coeffs, int num_threads,
             const std::optional<py::buffer>& importance) {
              fused_inverse(param, grad, exp_avg, exp_avg_sq, anchor, coeffs, num_threads, importance);
          },
          py::arg("param"), py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("anchor"),
          py::arg("coeffs"), py::arg("num_threads") = 0, py::arg("importance") = py::none(),
          "Undoes fused_step with the same coefficients and gradient, in place (cpp/step_args.h).");
}
