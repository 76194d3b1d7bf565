#pragma once
// Prometheus text exposition (format 0.0.4) of the serving metrics: counters, gauges and
// cumulative histograms, written as `GET /metrics` returns them.
//
//   std::string out;
//   prometheus::gauge(out, "dsp:num_requests_running", "Requests in the running batch.", 3);
//   prometheus::Histogram ttft(prometheus::Histogram::ttft_buckets());
//   ttft.observe(0.012);
//   ttft.write(out, "dsp:time_to_first_token_seconds", "Time to first token.");
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "dsp/core/error.hpp"

namespace dsp::serve::prometheus {

namespace detail {
// A sample value as Prometheus reads it: integers without a fraction, +Inf / -Inf / NaN,
// others in the fewest digits that read back as the same double (0.0005, not 0.00050000000000000001).
inline std::string number(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  char buf[64];
  if (v == std::floor(v) && std::fabs(v) < 1e15) {
    std::snprintf(buf, sizeof buf, "%.0f", v);
    return buf;
  }
  for (int digits = 1; digits <= 17; ++digits) {
    std::snprintf(buf, sizeof buf, "%.*g", digits, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  return buf;
}
inline void header(std::string& out, std::string_view name, std::string_view help, std::string_view type) {
  out.append("# HELP ").append(name).append(" ").append(help).append("\n");
  out.append("# TYPE ").append(name).append(" ").append(type).append("\n");
}
}  // namespace detail

/// Appends a gauge: `# HELP`, `# TYPE name gauge` and `name value`.
inline void gauge(std::string& out, std::string_view name, std::string_view help, double value) {
  detail::header(out, name, help, "gauge");
  out.append(name).append(" ").append(detail::number(value)).append("\n");
}

/// Appends a counter `name` (without its `_total` suffix, which prometheus_client's text
/// format puts on the HELP and TYPE lines and the sample alike): `name_total value`.
inline void counter(std::string& out, std::string_view name, std::string_view help, double value) {
  const std::string total = std::string(name) + "_total";
  detail::header(out, total, help, "counter");
  out.append(total).append(" ").append(detail::number(value)).append("\n");
}

/// Appends a counter with one label: one sample `name_total{label="value"} count` per entry.
inline void counter(std::string& out, std::string_view name, std::string_view help, std::string_view label,
                    const std::vector<std::pair<std::string, double>>& values) {
  detail::header(out, std::string(name) + "_total", help, "counter");
  for (const auto& [v, count] : values)
    out.append(name).append("_total{").append(label).append("=\"").append(v).append("\"} ").append(detail::number(count)).append("\n");
}

/// A cumulative histogram: observations counted in buckets of upper bounds `le` (ascending),
/// plus +Inf, their sum and count. Not thread-safe (the caller locks).
class Histogram {
 public:
  /// Throws Error unless `bounds` are finite and strictly ascending.
  explicit Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {
    for (std::size_t i = 0; i < bounds_.size(); ++i)
      DSP_CHECK(std::isfinite(bounds_[i]) && (i == 0 || bounds_[i] > bounds_[i - 1]),
                "Histogram: bucket bounds must be finite and strictly ascending");
  }
  /// Counts `v` (seconds, say) in the first bucket whose bound is >= v.
  void observe(double v) {
    std::size_t i = 0;
    while (i < bounds_.size() && v > bounds_[i]) ++i;
    ++counts_[i];
    sum_ += v;
    ++count_;
  }
  std::int64_t count() const { return count_; }
  double sum() const { return sum_; }
  /// Appends `name_bucket{le="..."}` (cumulative), `name_sum` and `name_count`.
  void write(std::string& out, std::string_view name, std::string_view help) const {
    detail::header(out, name, help, "histogram");
    std::int64_t cumulative = 0;
    for (std::size_t i = 0; i <= bounds_.size(); ++i) {
      cumulative += counts_[i];
      const std::string le = i < bounds_.size() ? detail::number(bounds_[i]) : "+Inf";
      out.append(name).append("_bucket{le=\"").append(le).append("\"} ").append(std::to_string(cumulative)).append("\n");
    }
    out.append(name).append("_sum ").append(detail::number(sum_)).append("\n");
    out.append(name).append("_count ").append(std::to_string(count_)).append("\n");
  }

  /// vLLM's buckets of time to first token (seconds), with 0.5 ms and 2.5 ms added below:
  /// a small model's first token on the CPU takes milliseconds.
  static std::vector<double> ttft_buckets() {
    return {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
            1.0,    2.5,   5.0,    7.5,   10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0};
  }
  /// vLLM's buckets of inter-token latency (seconds), with 0.25 ms to 5 ms added below.
  static std::vector<double> itl_buckets() {
    return {0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
            0.4,     0.5,    0.75,  1.0,    2.5,   5.0,  7.5,   10.0,  20.0, 40.0, 80.0};
  }
  /// vLLM's buckets of end-to-end request latency (seconds), with 10 ms to 0.1 s added below.
  static std::vector<double> e2e_buckets() {
    return {0.01, 0.025, 0.05, 0.1,  0.3,  0.5,  0.8,  1.0,   1.5,   2.0,   2.5,   5.0,   10.0, 15.0,
            20.0, 30.0,  40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0};
  }

 private:
  std::vector<double> bounds_;
  std::vector<std::int64_t> counts_;  // per bucket, not cumulative; the last is +Inf
  double sum_ = 0;
  std::int64_t count_ = 0;
};

}  // namespace dsp::serve::prometheus
