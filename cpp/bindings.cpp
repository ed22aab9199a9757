// pybind11 module ft_framework._cpu_kernel: runtime ISA dispatch and OpenMP threading around the
// per-ISA step ranges. Tensors arrive as raw addresses: the Python wrapper (ft_framework/optim/cpu.py)
// has already checked device, dtype, contiguity and sizes, so no torch headers are needed here.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <omp.h>
#include <xmmintrin.h>

#include <algorithm>
#include <stdexcept>
#include <string>
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

void fused_step(uintptr_t param, uintptr_t grad, uintptr_t exp_avg, uintptr_t exp_avg_sq,
                uintptr_t anchor, int64_t numel, bool grad_bf16, bool anchor_bf16,
                float beta1, float beta2, float one_minus_beta1, float one_minus_beta2, float eps, float denom_scale, float step_size,
                float pre_decay, float pre_pull, float post_pull, float post_decay, int num_threads) {
    if (numel < 0) throw std::invalid_argument("numel must be >= 0");
    if (!param || !grad || !exp_avg || !exp_avg_sq) throw std::invalid_argument("null tensor address");
    ftk::StepArgs s;
    s.param = reinterpret_cast<float*>(param);
    s.grad = reinterpret_cast<const void*>(grad);
    s.exp_avg = reinterpret_cast<float*>(exp_avg);
    s.exp_avg_sq = reinterpret_cast<float*>(exp_avg_sq);
    s.anchor = reinterpret_cast<const void*>(anchor);
    s.grad_type = grad_bf16 ? ftk::ElemType::BF16 : ftk::ElemType::F32;
    s.anchor_type = anchor_bf16 ? ftk::ElemType::BF16 : ftk::ElemType::F32;
    s.c = {beta1, beta2, eps, one_minus_beta1, one_minus_beta2, denom_scale, step_size, pre_decay, pre_pull, post_pull, post_decay};
    const RangeFn fn = range_fn(g_level);

    int threads = num_threads > 0 ? num_threads : omp_get_max_threads();
    if (numel < kMinParallelElems) threads = 1;
    if (threads == 1) {
        FlushDenormals ftz;
        fn(s, 0, numel);
        return;
    }
#pragma omp parallel num_threads(threads)
    {
        FlushDenormals ftz;  // MXCSR is per thread
        const int64_t nth = omp_get_num_threads(), tid = omp_get_thread_num();
        int64_t per = (numel + nth - 1) / nth;
        per = (per + kChunkAlign - 1) / kChunkAlign * kChunkAlign;
        const int64_t begin = std::min(numel, tid * per), end = std::min(numel, begin + per);
        if (begin < end) fn(s, begin, end);
    }
}

}  // namespace

PYBIND11_MODULE(_cpu_kernel, m) {
    m.doc() = "Fused one-pass CPU optimizer step (RecAdam, AdamW, BERTAdam, prior_wd) with runtime SIMD dispatch";
    m.def("supported_levels", &supported_levels,
          "SIMD levels this CPU can run, lowest first (the build always carries all three)");
    m.def("get_level", [] { return std::string(kLevelNames[static_cast<int>(g_level)]); });
    m.def("set_level", &set_level, py::arg("name"));
    m.def("max_threads", [] { return omp_get_max_threads(); });
    m.def("fused_step", &fused_step, py::call_guard<py::gil_scoped_release>(),
          py::arg("param"), py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("anchor"),
          py::arg("numel"), py::arg("grad_bf16"), py::arg("anchor_bf16"), py::arg("beta1"), py::arg("beta2"), py::arg("one_minus_beta1"), py::arg("one_minus_beta2"),
          py::arg("eps"), py::arg("denom_scale"), py::arg("step_size"), py::arg("pre_decay"),
          py::arg("pre_pull"), py::arg("post_pull"), py::arg("post_decay"), py::arg("num_threads"),
          "One fused step over `numel` fp32 parameters (addresses from tensor.data_ptr()); anchor=0 means none.");
}
