#pragma once
// The FLOP/s peak MFU is measured against, measured once per machine and cached: a start-up
// measurement on a busy machine (or one per MPI process, all at once) once ranged 17-224
// GFLOP/s on one host, and an MFU of 159.7% was printed. Here the best of several trials is
// kept in a cache file keyed by the CPU model, the core count and the backend, so every run
// on the machine divides by the same peak; delete the file (or pass --peak-flops) to change it.
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

#include <unistd.h>

#include "dsp/train/metrics.hpp"

namespace dsp::train {

/// Where the peak is cached: $DSP_PEAK_FLOPS_CACHE, else $XDG_CACHE_HOME/dsp/peak_flops.json,
/// else ~/.cache/dsp/peak_flops.json (./.dsp_peak_flops.json without a home).
inline std::filesystem::path peak_flops_cache_path() {
  if (const char* p = std::getenv("DSP_PEAK_FLOPS_CACHE"); p && *p) return p;
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x) return std::filesystem::path(x) / "dsp" / "peak_flops.json";
  if (const char* h = std::getenv("HOME"); h && *h) return std::filesystem::path(h) / ".cache" / "dsp" / "peak_flops.json";
  return ".dsp_peak_flops.json";
}

/// "<CPU model name> x <hardware threads> / <backend>": the cache key of this machine.
inline std::string machine_key(const std::string& backend) {
  std::string model = "unknown CPU";
  std::ifstream cpuinfo("/proc/cpuinfo");
  for (std::string line; std::getline(cpuinfo, line);)
    if (line.rfind("model name", 0) == 0) {
      const auto colon = line.find(':');
      if (colon != std::string::npos) model = line.substr(std::min(colon + 2, line.size()));
      break;
    }
  return model + " x " + std::to_string(std::thread::hardware_concurrency()) + " / " + backend;
}

namespace detail {
// The cache file's object of peaks by machine key; empty when missing or unreadable.
inline nlohmann::json read_peak_cache(const std::filesystem::path& cache) {
  std::ifstream in(cache);
  auto j = in ? nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false) : nlohmann::json();
  return j.is_object() ? j : nlohmann::json::object();
}
}  // namespace detail

/// The cached peak (FLOP/s) of `key` in `cache`, or 0 when there is none (or the file is
/// unreadable: it is then rewritten).
inline double read_cached_peak(const std::filesystem::path& cache, const std::string& key) {
  const auto j = detail::read_peak_cache(cache);
  return j.contains(key) && j[key].is_number() ? j[key].get<double>() : 0.0;
}

/// This machine's fp32 GEMM peak: the cached value, else the best of `trials` measurements of
/// `seconds` each (measure_sgemm_peak, every core), written to the cache (atomically: a
/// temporary file renamed; a cache that cannot be written is skipped). Call it while no other
/// work runs on the machine (dsp-train: before its rank threads start; under MPI on one
/// process per host while the others sleep).
template <class Backend>
double cached_sgemm_peak(const std::string& backend_name, int trials = 5, double seconds = 0.2,
                         const std::filesystem::path& cache = peak_flops_cache_path()) {
  const std::string key = machine_key(backend_name);
  if (const double cached = read_cached_peak(cache, key); cached > 0) return cached;
  double best = 0.0;
  for (int t = 0; t < trials; ++t) best = std::max(best, measure_sgemm_peak<Backend>(seconds));
  std::error_code ec;
  if (cache.has_parent_path()) std::filesystem::create_directories(cache.parent_path(), ec);
  nlohmann::json j = detail::read_peak_cache(cache);  // other machines' and backends' peaks stay
  j[key] = best;
  const auto tmp = cache.string() + ".tmp" + std::to_string(::getpid());
  if (std::ofstream out(tmp); out << j.dump(2) << '\n') std::filesystem::rename(tmp, cache, ec);
  std::filesystem::remove(tmp, ec);
  return best;
}

/// Whether an MFU is a figure: above 1 (100%) the peak it was divided by is wrong (too low),
/// and the value must be flagged, not printed.
inline bool plausible_mfu(double mfu) { return mfu <= 1.0; }

}  // namespace dsp::train
