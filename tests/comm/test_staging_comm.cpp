// StagingComm against the collectives' closed forms, with tensors in a test::GuardedSpace and an
// inner communicator that fails the test if it is ever handed memory of that space: every
// operation must reach it through host copies, in place or not, blocking or not.
#include <doctest/doctest.h>

#include <mutex>
#include <numeric>
#include <span>
#include <vector>

#include "dsp/comm/launch.hpp"
#include "dsp/comm/staging_comm.hpp"
#include "dsp/comm/thread_comm.hpp"
#include "dsp/core/tensor.hpp"
#include "../guarded_space.hpp"

using namespace dsp;

namespace comm_staging_comm_test {

namespace {

// ThreadComm that checks every span it gets is outside `space` (the staged host buffers).
class CheckingComm {
 public:
  CheckingComm(comm::ThreadComm c, const test::GuardedSpace* space) : c_(std::move(c)), space_(space) {}
  int rank() const { return c_.rank(); }
  int size() const { return c_.size(); }
  template <class T>
  void all_reduce(std::span<T> d, comm::ReduceOp op = comm::ReduceOp::Sum) { c_.all_reduce(host(d), op); }
  template <class T>
  comm::Work all_reduce_async(std::span<T> d, comm::ReduceOp op = comm::ReduceOp::Sum) {
    return c_.all_reduce_async(host(d), op);
  }
  template <class T>
  void reduce_scatter(std::span<const T> in, std::span<T> out, comm::ReduceOp op = comm::ReduceOp::Sum) {
    c_.reduce_scatter(host(in), host(out), op);
  }
  template <class T>
  comm::Work reduce_scatter_async(std::span<const T> in, std::span<T> out, comm::ReduceOp op = comm::ReduceOp::Sum) {
    return c_.reduce_scatter_async(host(in), host(out), op);
  }
  template <class T>
  void all_gather(std::span<const T> in, std::span<T> out) { c_.all_gather(host(in), host(out)); }
  template <class T>
  comm::Work all_gather_async(std::span<const T> in, std::span<T> out) { return c_.all_gather_async(host(in), host(out)); }
  template <class T>
  void broadcast(std::span<T> d, int root) { c_.broadcast(host(d), root); }
  template <class T>
  comm::Work broadcast_async(std::span<T> d, int root) { return c_.broadcast_async(host(d), root); }
  template <class T>
  void send(std::span<const T> d, int dst, int tag = 0) { c_.send(host(d), dst, tag); }
  template <class T>
  comm::Work send_async(std::span<const T> d, int dst, int tag = 0) { return c_.send_async(host(d), dst, tag); }
  template <class T>
  void recv(std::span<T> d, int src, int tag = 0) { c_.recv(host(d), src, tag); }
  template <class T>
  comm::Work recv_async(std::span<T> d, int src, int tag = 0) { return c_.recv_async(host(d), src, tag); }
  template <class T>
  void all_to_all_v(std::span<const T> in, std::vector<std::int64_t> sc, std::span<T> out, std::vector<std::int64_t> rc) {
    c_.all_to_all_v(host(in), std::move(sc), host(out), std::move(rc));
  }
  template <class T>
  comm::Work all_to_all_v_async(std::span<const T> in, std::vector<std::int64_t> sc, std::span<T> out,
                                std::vector<std::int64_t> rc) {
    return c_.all_to_all_v_async(host(in), std::move(sc), host(out), std::move(rc));
  }
  void barrier() { c_.barrier(); }
  comm::Work barrier_async() { return c_.barrier_async(); }
  CheckingComm split(int color, int key) { return {c_.split(color, key), space_}; }

 private:
  template <class S>
  S host(S s) const {
    if (!s.empty() && space_->holds(s.data())) {
      std::lock_guard lock(fail_mu);
      FAIL("the inner communicator was handed memory of the space");
    }
    return s;
  }
  static inline std::mutex fail_mu;
  comm::ThreadComm c_;
  const test::GuardedSpace* space_;
};

// Rank r's input: element i = r * 100 + i.
Tensor rank_values(int r, std::int64_t n, MemorySpace* space) {
  Tensor host({n}, memory::Category::Workspace, nullptr);
  for (std::int64_t i = 0; i < n; ++i) host[i] = static_cast<float>(r * 100 + i);
  return host.to(space);
}
std::vector<float> values(const Tensor& t) {
  const Tensor h = t.to_host();
  return {h.values().begin(), h.values().end()};
}

}  // namespace

TEST_CASE("StagingComm: every collective on space tensors equals its closed form, the inner one sees host copies only") {
  test::GuardedSpace space;
  constexpr int ranks = 2;
  constexpr std::int64_t n = 6;
  std::mutex mu;
  comm::launch(ranks, [&](comm::ThreadComm& world) {
    MemorySpaceScope scope(&space);
    comm::StagingComm<CheckingComm> c(CheckingComm(world.split(0, world.rank()), &space));
    const int r = c.rank();
    std::vector<float> sum(n), gathered(n * ranks);
    for (std::int64_t i = 0; i < n; ++i) sum[std::size_t(i)] = static_cast<float>(100 + 2 * i);  // 0*100+i + 1*100+i
    for (int q = 0; q < ranks; ++q)  // rank q's own block of rank_values(q, 2n)
      for (std::int64_t i = 0; i < n; ++i) gathered[std::size_t(q * n + i)] = static_cast<float>(q * 100 + q * n + i);

    Tensor a = rank_values(r, n, &space), b = rank_values(r, n, &space);
    c.all_reduce(a.raw_span());
    comm::Work w = c.all_reduce_async(b.raw_span());
    w.wait();
    // reduce_scatter in place: this rank's block of the input is the output.
    Tensor rs = rank_values(r, n * ranks, &space);
    c.reduce_scatter(std::span<const float>(rs.raw_span()), rs.raw_span().subspan(std::size_t(r * n), std::size_t(n)));
    // all_gather in place and asynchronously.
    Tensor ag({n * ranks});
    ag.copy_from_host(std::span<const float>(values(rank_values(r, n * ranks, nullptr))));
    c.all_gather_async(std::span<const float>(ag.raw_span().subspan(std::size_t(r * n), std::size_t(n))), ag.raw_span())
        .wait();
    // broadcast from rank 1, a send/recv pair, all_to_all_v of n/2 elements each way.
    Tensor bc = rank_values(r, n, &space);
    c.broadcast(bc.raw_span(), 1);
    Tensor sr = rank_values(r, n, &space);
    if (r == 0) c.send(std::span<const float>(sr.raw_span()), 1);
    else c.recv_async(sr.raw_span(), 0).wait();
    Tensor a2a_in = rank_values(r, n, &space), a2a_out({n});
    c.all_to_all_v(std::span<const float>(a2a_in.raw_span()), {n / 2, n / 2}, a2a_out.raw_span(), {n / 2, n / 2});

    std::lock_guard lk(mu);
    CAPTURE(r);
    CHECK(a.space() == &space);
    CHECK(values(a) == sum);
    CHECK(values(b) == sum);
    const auto rs_v = values(rs);
    std::vector<float> want_rs(n);  // block r of sum over ranks of rank_values(q, 2n)
    for (std::int64_t i = 0; i < n; ++i) want_rs[std::size_t(i)] = static_cast<float>(100 + 2 * (r * n + i));
    CHECK(std::vector<float>(rs_v.begin() + r * n, rs_v.begin() + (r + 1) * n) == want_rs);
    CHECK(values(ag) == gathered);
    CHECK(values(bc) == values(rank_values(1, n, nullptr)));
    CHECK(values(sr) == values(rank_values(0, n, nullptr)));
    std::vector<float> want_a2a(n);  // block r of each rank q's input, rank-major
    for (int q = 0; q < ranks; ++q)
      for (std::int64_t i = 0; i < n / 2; ++i)
        want_a2a[std::size_t(q * n / 2 + i)] = static_cast<float>(q * 100 + r * n / 2 + i);
    CHECK(values(a2a_out) == want_a2a);
  });
  CHECK(space.counters.total.live == 0);
}

TEST_CASE("StagingComm outside a memory space passes host spans straight through") {
  comm::launch(2, [&](comm::ThreadComm& world) {
    test::GuardedSpace unused;
    comm::StagingComm<CheckingComm> c(CheckingComm(world.split(0, world.rank()), &unused));
    std::vector<double> x{1.0, 2.0};
    c.all_reduce(std::span(x));
    CHECK(x == std::vector<double>{2.0, 4.0});
    CHECK(unused.allocations == 0);
  });
}

}  // namespace comm_staging_comm_test
