#pragma once
// Weights copied once into the layout the host batch-invariant GEMM streams fastest (llama.cpp's
// and oneDNN's "repacking"): a weight w [n, k] (a linear layer's [out, in]) becomes ceil(n / 48)
// panels, each [k, 48]: for every k the 48 columns' values side by side, zero past n. A step of
// 1-64 decoding tokens reads each weight once, so its speed is the rate it streams B: one
// sequential stream per panel instead of one per column (48 rows of w, each its own page).
// serve::Engine packs its model's weights at start (they do not change while it serves) and
// opens a PackedWeightsScope for every step; gemm_nt_batch_invariant (gemm_batch_invariant.hpp)
// reads a weight's panels when the scope holds them and its own kernels run on this machine
// (backend::reads_packed_weights()), and B in place otherwise. The result is the same bitwise
// either way: each element is the same chain of fused multiply-adds.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "dsp/backend/host/host.hpp"
#include "dsp/backend/host/parallel_for.hpp"
#include "dsp/core/error.hpp"
#include "dsp/core/memory.hpp"
#include "dsp/core/thread_scope.hpp"

namespace dsp::backend {

/// Columns of w in one panel of a PackedWeights (a multiple of every tile width of the GEMM).
constexpr std::int64_t packed_panel_width = 48;

/// Copies of weights in the panel layout (header comment), found by the address of the weight
/// they copy; their bytes count as memory::Category::Parameters. The copies do not follow later
/// changes of the weights, nor a weight moved to another buffer (whose old address another
/// matrix may then take): pack weights that stay where and as they are while the copies are
/// used (a served model's; serve::Engine checks the addresses at every step).
class PackedWeights {
 public:
  /// Packs w [n, k] (row-major, contiguous; n, k >= 0), on the rank's threads. Packing the same
  /// address again replaces its copy.
  void add(Host h, const float* w, std::int64_t n, std::int64_t k) {
    DSP_CHECK(n >= 0 && k >= 0, "PackedWeights::add: negative size ", n, " x ", k);
    const std::int64_t panels = (n + packed_panel_width - 1) / packed_panel_width;
    Packed& p = packed_.try_emplace(w).first->second;
    p.n = n;
    p.k = k;
    p.panels.assign(static_cast<std::size_t>(panels * k * packed_panel_width), 0.0f);
    float* out = p.panels.data();
    parallel_for(h, panels, [&](std::int64_t u) {
      const std::int64_t j0 = u * packed_panel_width, cols = std::min(packed_panel_width, n - j0);
      float* panel = out + u * k * packed_panel_width;
      for (std::int64_t j = 0; j < cols; ++j) {
        const float* row = w + (j0 + j) * k;
        for (std::int64_t kk = 0; kk < k; ++kk) panel[kk * packed_panel_width + j] = row[kk];
      }
    });
  }

  /// The panels of the weight at `w` packed with these n and k, when read as a contiguous
  /// [n, k] matrix (ldw == k); nullptr otherwise (another shape, a slice of a weight, or a
  /// matrix never packed).
  const float* find(const float* w, std::int64_t n, std::int64_t k, std::int64_t ldw) const {
    const auto it = packed_.find(w);
    if (it == packed_.end() || it->second.n != n || it->second.k != k || ldw != k) return nullptr;
    return it->second.panels.data();
  }

  /// Counts a GEMM that read panels found here (gemm_nt_batch_invariant calls it).
  void count_read() const { reads_->fetch_add(1, std::memory_order_relaxed); }
  /// GEMMs that read panels found here so far.
  std::int64_t reads() const { return reads_->load(std::memory_order_relaxed); }

  /// Bytes the copies hold (padding included).
  std::int64_t bytes() const {
    std::int64_t b = 0;
    for (const auto& [w, p] : packed_) b += static_cast<std::int64_t>(p.panels.size() * sizeof(float));
    return b;
  }

 private:
  struct Packed {
    std::int64_t n = 0, k = 0;
    std::vector<float, memory::CountingAllocator<float>> panels{
        memory::CountingAllocator<float>(memory::Category::Parameters)};
  };
  std::map<const float*, Packed> packed_;
  std::unique_ptr<std::atomic<std::int64_t>> reads_ = std::make_unique<std::atomic<std::int64_t>>(0);
};

/// Makes the calling thread's batch-invariant GEMMs read `weights`' panels for the weights it
/// holds until the scope ends, then restores the previous setting (scopes nest). Belongs to
/// one thread's stack; `weights` must outlive it.
class PackedWeightsScope : public ThreadScope<PackedWeightsScope, const PackedWeights*> {
 public:
  explicit PackedWeightsScope(const PackedWeights* weights) : ThreadScope(weights) {}
};

/// The PackedWeights of the calling thread's innermost PackedWeightsScope (nullptr outside).
inline const PackedWeights* packed_weights() { return PackedWeightsScope::current(); }

}  // namespace dsp::backend
