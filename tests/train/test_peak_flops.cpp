// The cached machine peak (train/peak_flops.hpp): measured once (best of its trials) and then
// read back from the cache for the same machine key, other keys kept; an MFU over 100% is
// not a figure.
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <random>

#include "dsp/backend/host.hpp"
#include "dsp/train/peak_flops.hpp"

namespace train_peak_flops_test {
namespace fs = std::filesystem;

TEST_CASE("the sgemm peak is measured once, cached per machine key, and read back") {
  const fs::path dir = fs::temp_directory_path() / ("dsp_peak_" + std::to_string(std::random_device{}()));
  const fs::path cache = dir / "sub" / "peak.json";
  const std::string key = dsp::train::machine_key("host");
  CHECK(key.find(" x ") != std::string::npos);
  CHECK(dsp::train::read_cached_peak(cache, key) == 0.0);
  const double measured = dsp::train::cached_sgemm_peak<dsp::backend::Host>("host", 2, 0.05, cache);
  CHECK(measured > 1e8);  // any machine that runs this does more than 0.1 GFLOP/s
  CHECK(dsp::train::read_cached_peak(cache, key) == measured);
  // A value in the cache is what the next run uses (no new measurement): written by hand here.
  std::ofstream(cache) << "{\"other machine\": 5.0, \"" << key << "\": 123.0}";
  CHECK(dsp::train::cached_sgemm_peak<dsp::backend::Host>("host", 2, 0.05, cache) == 123.0);
  CHECK(dsp::train::read_cached_peak(cache, "other machine") == 5.0);
  // Another backend of the same machine is measured and added; the others stay.
  const double other = dsp::train::cached_sgemm_peak<dsp::backend::Host>("host-bf16", 1, 0.05, cache);
  CHECK(dsp::train::read_cached_peak(cache, dsp::train::machine_key("host-bf16")) == other);
  CHECK(dsp::train::read_cached_peak(cache, key) == 123.0);
  std::ofstream(cache) << "not json";  // unreadable: measured again and rewritten
  CHECK(dsp::train::cached_sgemm_peak<dsp::backend::Host>("host", 1, 0.05, cache) > 1e8);
  fs::remove_all(dir);
}

TEST_CASE("an MFU over 100% is flagged, not a figure") {
  CHECK(dsp::train::plausible_mfu(0.42));
  CHECK(dsp::train::plausible_mfu(1.0));
  CHECK_FALSE(dsp::train::plausible_mfu(1.597));
}

}  // namespace train_peak_flops_test
