// Prometheus text exposition: cumulative histogram buckets, counter and gauge samples.
#include <doctest/doctest.h>

#include <string>

#include "dsp/serve/prometheus.hpp"

namespace pm = dsp::serve::prometheus;

TEST_CASE("prometheus: a histogram's buckets are cumulative, with +Inf, sum and count") {
  pm::Histogram h({0.1, 1.0});
  for (double v : {0.05, 0.1, 0.5, 2.0, 3.0}) h.observe(v);  // 0.1 falls in le="0.1" (bounds are inclusive)
  std::string out;
  h.write(out, "dsp:x_seconds", "X.");
  CHECK(out ==
        "# HELP dsp:x_seconds X.\n# TYPE dsp:x_seconds histogram\n"
        "dsp:x_seconds_bucket{le=\"0.1\"} 2\n"
        "dsp:x_seconds_bucket{le=\"1\"} 3\n"
        "dsp:x_seconds_bucket{le=\"+Inf\"} 5\n"
        "dsp:x_seconds_sum 5.65\n"
        "dsp:x_seconds_count 5\n");
  CHECK_THROWS_AS(pm::Histogram({1.0, 1.0}), dsp::Error);
}

TEST_CASE("prometheus: counters get _total (HELP, TYPE and samples, as prometheus_client); labelled counters one sample per value") {
  std::string out;
  pm::gauge(out, "dsp:g", "G.", 3);
  pm::counter(out, "dsp:c", "C.", 7);
  pm::counter(out, "dsp:r", "R.", "finished_reason", {{"stop", 2}, {"length", 0}});
  CHECK(out ==
        "# HELP dsp:g G.\n# TYPE dsp:g gauge\ndsp:g 3\n"
        "# HELP dsp:c_total C.\n# TYPE dsp:c_total counter\ndsp:c_total 7\n"
        "# HELP dsp:r_total R.\n# TYPE dsp:r_total counter\ndsp:r_total{finished_reason=\"stop\"} 2\n"
        "dsp:r_total{finished_reason=\"length\"} 0\n");
}
