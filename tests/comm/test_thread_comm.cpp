// ThreadComm collectives against closed forms on rank-valued inputs.
#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <numeric>
#include <stdexcept>
#include <thread>

#include "dsp/comm/launch.hpp"
#include "dsp/core/dtype.hpp"

using dsp::bf16;
using dsp::comm::launch;
using dsp::comm::ReduceOp;
using dsp::comm::ThreadComm;

TEST_CASE("all_reduce sum/max/min match closed forms on rank-valued inputs") {
  for (int n : {1, 2, 3, 4}) {
    launch(n, [n](ThreadComm& c) {
      const int r = c.rank();
      for (int count : {0, 1, 7, 1000}) {
        std::vector<float> sum(count), mx(count), mn(count);
        for (int i = 0; i < count; ++i) sum[i] = mx[i] = mn[i] = float(r * 1000 + i);
        c.all_reduce(std::span(sum), ReduceOp::Sum);
        c.all_reduce(std::span(mx), ReduceOp::Max);
        c.all_reduce(std::span(mn), ReduceOp::Min);
        for (int i = 0; i < count; ++i) {
          CHECK(sum[i] == float(1000 * n * (n - 1) / 2 + n * i));  // sum_r (1000 r + i)
          CHECK(mx[i] == float((n - 1) * 1000 + i));
          CHECK(mn[i] == float(i));
        }
      }
    });
  }
}

TEST_CASE("bf16 all_reduce accumulates in fp32 and rounds once") {
  // 1 + 8 * 2^-9: every partial sum 1 + k 2^-9 is not representable in bf16 (8 bits of
  // mantissa: spacing 2^-7 at 1.0), so bf16 accumulation would stay at 1.0; fp32 gives
  // 1 + 2^-6, which is exact in bf16.
  launch(9, [](ThreadComm& c) {
    std::vector<bf16> x(5, bf16(c.rank() == 0 ? 1.0f : 0x1.0p-9f));
    c.all_reduce(std::span(x));
    for (auto v : x) CHECK(static_cast<float>(v) == 1.0f + 0x1.0p-6f);
  });
}

TEST_CASE("reduce_scatter, all_gather and broadcast") {
  launch(4, [](ThreadComm& c) {
    const int r = c.rank(), n = c.size(), m = 3;
    std::vector<float> in(n * m), out(m);
    for (int i = 0; i < n * m; ++i) in[i] = float(r + 10 * i);
    c.reduce_scatter(std::span<const float>(in), std::span(out));
    for (int i = 0; i < m; ++i) CHECK(out[i] == float(6 + 4 * 10 * (r * m + i)));  // sum_r r = 6

    std::vector<float> mine(m, float(r)), all(n * m);
    c.all_gather(std::span<const float>(mine), std::span(all));
    for (int i = 0; i < n * m; ++i) CHECK(all[i] == float(i / m));

    std::vector<float> b(5, float(r));
    c.broadcast(std::span(b), 2);
    for (float v : b) CHECK(v == 2.0f);
  });
}

TEST_CASE("all_to_all_v with uneven and zero counts") {
  launch(3, [](ThreadComm& c) {
    const int r = c.rank(), n = c.size();
    // rank s sends (s + d) % 3 elements of value 100 s + d to rank d (zero for some pairs)
    std::vector<std::int64_t> sc(n), rc(n);
    std::vector<float> in;
    for (int d = 0; d < n; ++d) {
      sc[d] = (r + d) % 3;
      in.insert(in.end(), sc[d], float(100 * r + d));
    }
    for (int s = 0; s < n; ++s) rc[s] = (s + r) % 3;
    std::vector<float> out(std::accumulate(rc.begin(), rc.end(), std::int64_t{0}));
    c.all_to_all_v(std::span<const float>(in), sc, std::span(out), rc);
    std::size_t k = 0;
    for (int s = 0; s < n; ++s)
      for (int j = 0; j < rc[s]; ++j) CHECK(out[k++] == float(100 * s + r));
  });
}

TEST_CASE("all_to_all_v where a whole rank receives nothing") {
  launch(2, [](ThreadComm& c) {
    std::vector<float> in(c.rank() == 0 ? 0 : 4, 7.0f);
    std::vector<std::int64_t> sc = c.rank() == 0 ? std::vector<std::int64_t>{0, 0} : std::vector<std::int64_t>{4, 0};
    std::vector<std::int64_t> rc = c.rank() == 0 ? std::vector<std::int64_t>{0, 4} : std::vector<std::int64_t>{0, 0};
    std::vector<float> out(c.rank() == 0 ? 4 : 0);
    c.all_to_all_v(std::span<const float>(in), sc, std::span(out), rc);
    for (float v : out) CHECK(v == 7.0f);
  });
}

TEST_CASE("send/recv, async forms and split into sub-groups") {
  launch(4, [](ThreadComm& c) {
    const int r = c.rank();
    std::vector<float> msg(3, float(r)), got(3);
    const int next = (r + 1) % 4, prev = (r + 3) % 4;
    auto s = c.send_async(std::span<const float>(msg), next, 5);
    auto w = c.recv_async(std::span(got), prev, 5);
    std::vector<float> x(8, 1.0f);
    auto a = c.all_reduce_async(std::span(x));
    s.wait();
    w.wait();
    a.wait();
    CHECK(got[0] == float(prev));
    CHECK(x[7] == 4.0f);

    ThreadComm by_half;
    auto split_work = c.split_async(r / 2, r, by_half);
    ThreadComm sub = c.split(r % 2, -r);  // key -r reverses the order inside each colour
    split_work.wait();
    CHECK(by_half.size() == 2);
    CHECK(by_half.rank() == r % 2);
    CHECK(sub.size() == 2);
    CHECK(sub.rank() == (r < 2 ? 1 : 0));
    std::vector<float> v{float(r)};
    sub.all_reduce(std::span(v));
    CHECK(v[0] == float(r % 2 == 0 ? 0 + 2 : 1 + 3));
  });
}

TEST_CASE("a rank that throws aborts the others and launch rethrows its error") {
  std::atomic<int> aborted{0};
  auto run = [&] {
    launch(3, [&](ThreadComm& c) {
      if (c.rank() == 1) throw std::invalid_argument("rank one broke");
      std::vector<float> x(4);
      try {
        c.all_reduce(std::span(x));  // can never complete: rank 1 is gone
      } catch (const dsp::AbortedError&) {
        ++aborted;
        throw;
      }
    });
  };
  CHECK_THROWS_WITH_AS(run(), "rank one broke", std::invalid_argument);
  CHECK(aborted == 2);
}

TEST_CASE("a collective that waits past the timeout throws instead of hanging") {
  dsp::comm::LaunchOptions opt;
  opt.timeout = std::chrono::milliseconds(200);
  const auto t0 = std::chrono::steady_clock::now();
  CHECK_THROWS_AS(launch(
                      2,
                      [](ThreadComm& c) {
                        if (c.rank() == 0) c.barrier();  // rank 1 never comes
                        else std::this_thread::sleep_for(std::chrono::milliseconds(600));
                      },
                      opt),
                  dsp::TimeoutError);
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(5));
}

TEST_CASE("mismatched sizes fail on every rank") {
  CHECK_THROWS_AS(launch(2,
                         [](ThreadComm& c) {
                           std::vector<float> x(c.rank() + 1);
                           c.all_reduce(std::span(x));
                         }),
                  dsp::CommError);
}

TEST_CASE("a pending recv_async does not hold up a later send or collective") {
  dsp::comm::LaunchOptions opt;
  opt.timeout = std::chrono::seconds(20);
  launch(
      2,
      [](ThreadComm& c) {
        const int peer = 1 - c.rank();
        std::vector<float> in(4), out(4, float(c.rank()));
        auto w = c.recv_async(std::span(in), peer);  // posted before the matching send exists
        c.send(std::span<const float>(out), peer);
        std::vector<float> x{1.0f};
        c.all_reduce(std::span(x));
        w.wait();
        CHECK(in[0] == float(peer));
        CHECK(x[0] == 2.0f);
      },
      opt);
}

TEST_CASE("a rank that throws with asynchronous work queued aborts the others at once") {
  dsp::comm::LaunchOptions opt;
  opt.timeout = std::chrono::seconds(60);
  const auto t0 = std::chrono::steady_clock::now();
  auto run = [&] {
    launch(
        2,
        [](ThreadComm& c) {
          std::vector<float> x(4), y(4);
          if (c.rank() == 0) {
            auto w = c.all_reduce_async(std::span(x));
            throw std::runtime_error("rank zero broke with work pending");
          }
          c.recv(std::span(y), 0);  // never sent
        },
        opt);
  };
  CHECK_THROWS_WITH_AS(run(), "rank zero broke with work pending", std::runtime_error);
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(10));  // not the 60 s timeout
}

TEST_CASE("an asynchronous failure nobody waited on still fails the launch") {
  dsp::comm::LaunchOptions opt;
  opt.timeout = std::chrono::milliseconds(200);
  CHECK_THROWS_AS(launch(
                      2,
                      [](ThreadComm& c) {
                        std::vector<float> x(4);
                        if (c.rank() == 0) auto w = c.all_reduce_async(std::span(x));  // rank 1 never joins
                        else std::this_thread::sleep_for(std::chrono::milliseconds(600));
                      },
                      opt),
                  dsp::CommError);
}

TEST_CASE("different collectives at the same point fail on every rank with a clear message") {
  std::atomic<int> failures{0};
  auto run = [&] {
    launch(2, [&](ThreadComm& c) {
      std::vector<float> x(4), in(8), out(4);
      try {
        if (c.rank() == 0) c.all_reduce(std::span(x));
        else c.reduce_scatter(std::span<const float>(in), std::span(out));
      } catch (const dsp::CommError&) {
        ++failures;
        throw;
      }
    });
  };
  CHECK_THROWS_WITH_AS(run(), "collective mismatch: rank 0 called all_reduce, rank 1 called reduce_scatter",
                       dsp::CommError);
  CHECK(failures == 2);
}
