// MpiComm collectives, asynchronous forms, split and errors against closed forms on
// rank-valued inputs. Every rank runs every case (ctest starts this binary with mpiexec -n 2
// and -n 4), so each case must call the same collectives on every rank.
#include <doctest/doctest.h>
#include <sys/mman.h>

#include <climits>
#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

#include "dsp/comm/communicator.hpp"
#include "dsp/comm/mpi_launch.hpp"
#include "dsp/core/dtype.hpp"
#include "dsp/parallel/device_mesh.hpp"

using dsp::bf16;
using dsp::fp16;
using dsp::comm::MpiComm;
using dsp::comm::ReduceOp;
using dsp::comm::Work;

static_assert(dsp::comm::Communicator<MpiComm>);

namespace {

MpiComm world() { return MpiComm::world(); }

template <class T>
void check_all_reduce(MpiComm& c, int count, bool async) {
  const int r = c.rank(), n = c.size();
  std::vector<T> sum(static_cast<std::size_t>(count)), mx(sum), mn(sum);
  for (int i = 0; i < count; ++i) sum[i] = mx[i] = mn[i] = static_cast<T>(r * 1000 + i);
  if (async) {
    // all three in flight at once, waited for in reverse order
    Work a = c.all_reduce_async(std::span(sum), ReduceOp::Sum);
    Work b = c.all_reduce_async(std::span(mx), ReduceOp::Max);
    Work d = c.all_reduce_async(std::span(mn), ReduceOp::Min);
    d.wait();
    b.wait();
    a.wait();
    CHECK(a.completed());
  } else {
    c.all_reduce(std::span(sum), ReduceOp::Sum);
    c.all_reduce(std::span(mx), ReduceOp::Max);
    c.all_reduce(std::span(mn), ReduceOp::Min);
  }
  for (int i = 0; i < count; ++i) {
    CHECK(sum[i] == static_cast<T>(1000 * n * (n - 1) / 2 + n * i));  // sum_r (1000 r + i)
    CHECK(mx[i] == static_cast<T>((n - 1) * 1000 + i));
    CHECK(mn[i] == static_cast<T>(i));
  }
}

// 1 on rank 0 plus 0.75 ulp(1) on every other rank. Summed in fp32 and rounded once the result
// is round(1 + 0.75 (n-1) ulp); rounding after every addition instead gives 1 + (n-1) ulp
// (each 1 + k ulp + 0.75 ulp rounds up), which differs from n = 3 on.
template <class T>
void check_half_all_reduce(MpiComm& c, bool async) {
  const int n = c.size();
  const float ulp = std::is_same_v<T, bf16> ? 0x1.0p-7f : 0x1.0p-10f;  // spacing at 1.0
  std::vector<T> x(5, T(c.rank() == 0 ? 1.0f : 0.75f * ulp));
  if (async) c.all_reduce_async(std::span(x)).wait();
  else c.all_reduce(std::span(x));
  const float expected = static_cast<float>(T(1.0f + 0.75f * ulp * static_cast<float>(n - 1)));
  float stepwise = 1.0f;
  for (int q = 1; q < n; ++q) stepwise = static_cast<float>(T(stepwise + 0.75f * ulp));
  if (n >= 3) REQUIRE(expected != stepwise);  // the inputs tell the two apart
  for (auto v : x) CHECK(static_cast<float>(v) == expected);
}

}  // namespace

TEST_CASE("world: rank and size") {
  MpiComm c = world();
  CHECK(c.valid());
  CHECK(c.size() >= 2);
  CHECK(c.rank() >= 0);
  CHECK(c.rank() < c.size());
}

TEST_CASE("all_reduce sum/max/min match closed forms for float, double, int32, int64") {
  MpiComm c = world();
  for (bool async : {false, true})
    for (int count : {0, 1, 7, 1000}) {
      CAPTURE(async);
      CAPTURE(count);
      check_all_reduce<float>(c, count, async);
      check_all_reduce<double>(c, count, async);
      check_all_reduce<std::int32_t>(c, count, async);
      check_all_reduce<std::int64_t>(c, count, async);
    }
}

TEST_CASE("bf16 and fp16 all_reduce accumulate in fp32 and round once") {
  MpiComm c = world();
  for (bool async : {false, true}) {
    CAPTURE(async);
    check_half_all_reduce<bf16>(c, async);
    check_half_all_reduce<fp16>(c, async);
  }
}

TEST_CASE("reduce_scatter: closed form, in place, int and bf16, blocking and async") {
  MpiComm c = world();
  const int r = c.rank(), n = c.size(), m = 3;
  const float tri = static_cast<float>(n * (n - 1) / 2);  // sum_r r
  for (bool async : {false, true}) {
    CAPTURE(async);
    std::vector<float> in(n * m), out(m);
    for (int i = 0; i < n * m; ++i) in[i] = float(r + 10 * i);
    auto rs = [&](auto in_span, auto out_span) {
      if (async) c.reduce_scatter_async(in_span, out_span).wait();
      else c.reduce_scatter(in_span, out_span);
    };
    rs(std::span<const float>(in), std::span(out));
    for (int i = 0; i < m; ++i) CHECK(out[i] == tri + float(n * 10 * (r * m + i)));

    // `out` is the first block of `in` (overlapping buffers)
    std::vector<float> buf = in;
    rs(std::span<const float>(buf), std::span(buf).first(m));
    for (int i = 0; i < m; ++i) CHECK(buf[i] == tri + float(n * 10 * (r * m + i)));

    std::vector<std::int64_t> iin(n * m), iout(m);
    for (int i = 0; i < n * m; ++i) iin[i] = r * 100 + i;
    rs(std::span<const std::int64_t>(iin), std::span(iout));
    for (int i = 0; i < m; ++i) CHECK(iout[i] == 100 * n * (n - 1) / 2 + n * (r * m + i));

    // bf16: 1 + 0.75 ulp per other rank, as for all_reduce
    std::vector<bf16> hin(n * m, bf16(r == 0 ? 1.0f : 0.75f * 0x1.0p-7f)), hout(m);
    rs(std::span<const bf16>(hin), std::span(hout));
    for (auto v : hout) CHECK(static_cast<float>(v) == static_cast<float>(bf16(1.0f + 0.75f * 0x1.0p-7f * float(n - 1))));
  }
}

TEST_CASE("all_gather (out of place, in place, bf16 raw) and broadcast (every root, bytes)") {
  MpiComm c = world();
  const int r = c.rank(), n = c.size(), m = 3;
  for (bool async : {false, true}) {
    CAPTURE(async);
    std::vector<float> mine(m), all(n * m);
    for (int i = 0; i < m; ++i) mine[i] = float(r * 10 + i);
    if (async) c.all_gather_async(std::span<const float>(mine), std::span(all)).wait();
    else c.all_gather(std::span<const float>(mine), std::span(all));
    for (int i = 0; i < n * m; ++i) CHECK(all[i] == float((i / m) * 10 + i % m));

    std::vector<std::int32_t> inplace(n * m, -1);
    for (int i = 0; i < m; ++i) inplace[r * m + i] = r * 10 + i;
    auto block = std::span<const std::int32_t>(inplace).subspan(r * m, m);
    if (async) c.all_gather_async(block, std::span(inplace)).wait();
    else c.all_gather(block, std::span(inplace));
    for (int i = 0; i < n * m; ++i) CHECK(inplace[i] == (i / m) * 10 + i % m);

    // bf16 moves as raw 2-byte elements: bit patterns arrive unchanged (a NaN payload too)
    std::vector<bf16> h(1), hall(n);
    h[0].bits = static_cast<std::uint16_t>(0x7f81 + r);
    if (async) c.all_gather_async(std::span<const bf16>(h), std::span(hall)).wait();
    else c.all_gather(std::span<const bf16>(h), std::span(hall));
    for (int q = 0; q < n; ++q) CHECK(hall[q].bits == 0x7f81 + q);

    for (int root = 0; root < n; ++root) {
      std::vector<double> x(4, r == root ? 3.5 + root : -1.0);
      std::string s = r == root ? "root " + std::to_string(root) : std::string(6, '?');
      if (async) {
        Work a = c.broadcast_async(std::span(x), root);
        Work b = c.broadcast_async(std::span(s.data(), s.size()), root);
        while (!b.completed()) {
        }
        b.wait();
        a.wait();
      } else {
        c.broadcast(std::span(x), root);
        c.broadcast(std::span(s.data(), s.size()), root);
      }
      for (double v : x) CHECK(v == 3.5 + root);
      CHECK(s == "root " + std::to_string(root));
    }
  }
}

TEST_CASE("send/recv around a ring: buffered sends, blocking and async receives") {
  MpiComm c = world();
  const int r = c.rank(), n = c.size(), next = (r + 1) % n, prev = (r + n - 1) % n;
  // Every rank sends before it receives: only buffered sends make this deadlock-free for
  // messages above MPI's eager limit (256 K floats = 1 MiB).
  std::vector<float> big(1 << 18, float(r));
  c.send(std::span<const float>(big), next, 7);
  std::vector<float> got(big.size());
  c.recv(std::span(got), prev, 7);
  CHECK(got.front() == float(prev));
  CHECK(got.back() == float(prev));

  // two tags, received out of order, and async receives posted before the sends
  std::vector<std::int64_t> a(3), b(5);
  Work wb = c.recv_async(std::span(b), prev, 2);
  Work wa = c.recv_async(std::span(a), prev, 1);
  std::vector<std::int64_t> sa(3, r), sb(5, 100 + r);
  c.send_async(std::span<const std::int64_t>(sa), next, 1).wait();
  c.send(std::span<const std::int64_t>(sb), next, 2);
  wa.wait();
  wb.wait();
  for (auto v : a) CHECK(v == prev);
  for (auto v : b) CHECK(v == 100 + prev);

  // messages with one (source, tag) arrive in send order
  for (int k = 0; k < 4; ++k) c.send(std::span<const int>(&k, 1), next, 3);
  for (int k = 0; k < 4; ++k) {
    int v = -1;
    c.recv(std::span(&v, 1), prev, 3);
    CHECK(v == k);
  }
  c.barrier();
}

TEST_CASE("recv size mismatches throw CommError") {
  MpiComm c = world();
  const int r = c.rank(), n = c.size(), next = (r + 1) % n, prev = (r + n - 1) % n;
  std::vector<float> three(3, 1.0f);
  c.send(std::span<const float>(three), next, 4);
  std::vector<float> four(4);
  CHECK_THROWS_WITH_AS(c.recv(std::span(four), prev, 4), doctest::Contains("sent 3 elements, expected 4"),
                       dsp::CommError);
  c.send(std::span<const float>(three), next, 5);
  std::vector<float> two(2);
  CHECK_THROWS_WITH_AS(c.recv_async(std::span(two), prev, 5).wait(), doctest::Contains("MPI_ERR_TRUNCATE"),
                       dsp::CommError);
  c.barrier();
}

TEST_CASE("all_to_all_v with zero counts, blocking and async") {
  MpiComm c = world();
  const int r = c.rank(), n = c.size();
  auto count = [](int src, int dst) { return static_cast<std::int64_t>((src + 2 * dst) % 3); };  // zeros included
  std::vector<std::int64_t> sc(n), rc(n);
  for (int q = 0; q < n; ++q) {
    sc[q] = count(r, q);
    rc[q] = count(q, r);
  }
  std::vector<std::int32_t> in;
  for (int q = 0; q < n; ++q)
    for (int i = 0; i < sc[q]; ++i) in.push_back(r * 10000 + q * 100 + i);  // (src, dst, index)
  for (bool async : {false, true}) {
    CAPTURE(async);
    std::vector<std::int32_t> out(static_cast<std::size_t>(std::accumulate(rc.begin(), rc.end(), std::int64_t{0})), -1);
    if (async) c.all_to_all_v_async(std::span<const std::int32_t>(in), sc, std::span(out), rc).wait();
    else c.all_to_all_v(std::span<const std::int32_t>(in), sc, std::span(out), rc);
    std::size_t k = 0;
    for (int q = 0; q < n; ++q)
      for (int i = 0; i < rc[q]; ++i) CHECK(out[k++] == q * 10000 + r * 100 + i);
  }
  // all counts zero
  std::vector<float> none;
  c.all_to_all_v(std::span<const float>(none), std::vector<std::int64_t>(n, 0), std::span(none),
                 std::vector<std::int64_t>(n, 0));
}

TEST_CASE("all_to_all_v count mismatch throws the same CommError on every rank") {
  MpiComm c = world();
  const int r = c.rank(), n = c.size();
  // every rank sends 1 element to each rank, but rank n-1 expects 2 from rank 0
  std::vector<std::int64_t> sc(n, 1), rc(n, 1);
  if (r == n - 1) rc[0] = 2;
  std::vector<float> in(n, 1.0f), out(static_cast<std::size_t>(n + (r == n - 1)));
  const std::string expected = "all_to_all_v: rank 0 sends 1 elements to rank " + std::to_string(n - 1) + ", which expects 2";
  CHECK_THROWS_WITH_AS(c.all_to_all_v(std::span<const float>(in), sc, std::span(out), rc), expected.c_str(),
                       dsp::CommError);
  CHECK_THROWS_WITH_AS(c.all_to_all_v_async(std::span<const float>(in), sc, std::span(out), rc).wait(),
                       expected.c_str(), dsp::CommError);
  c.barrier();  // still usable
}

TEST_CASE("barrier and barrier_async; completed() polls to true") {
  MpiComm c = world();
  c.barrier();
  Work w = c.barrier_async();
  while (!w.completed()) {
  }
  w.wait();
  CHECK(Work().completed());
}

TEST_CASE("split: colours, keys, sub-group collectives, split of a split, split_async, moves") {
  MpiComm c = world();
  const int r = c.rank(), n = c.size();
  // colour r % 2, key -r: reversed order inside each colour
  MpiComm half = c.split(r % 2, -r);
  const int members = (n - r % 2 + 1) / 2;
  CHECK(half.size() == members);
  CHECK(half.rank() == members - 1 - r / 2);
  std::vector<std::int32_t> x{r};
  half.all_reduce(std::span(x));
  int expected = 0;
  for (int q = r % 2; q < n; q += 2) expected += q;
  CHECK(x[0] == expected);
  // the lowest-keyed member (the highest old rank) broadcasts its old rank
  std::vector<std::int32_t> root{r};
  half.broadcast(std::span(root), 0);
  CHECK(root[0] == r % 2 + 2 * (members - 1));

  MpiComm single = half.split(half.rank(), 0);  // every rank alone
  CHECK(single.size() == 1);
  CHECK(single.rank() == 0);
  std::vector<float> y{2.5f};
  single.all_reduce(std::span(y));
  CHECK(y[0] == 2.5f);

  MpiComm async_out;
  CHECK_FALSE(async_out.valid());
  Work w = c.split_async(0, r, async_out);
  w.wait();
  CHECK(async_out.size() == n);
  CHECK(async_out.rank() == r);

  MpiComm moved = std::move(async_out);
  CHECK_FALSE(async_out.valid());
  CHECK(moved.valid());
  std::vector<float> z{1.0f};
  moved.all_reduce(std::span(z));
  CHECK(z[0] == float(n));
  CHECK_THROWS_AS(async_out.barrier(), dsp::CommError);
  CHECK_THROWS_WITH_AS(c.split(-1, 0), "split: colour must be >= 0, got -1", dsp::CommError);
}

TEST_CASE("DeviceMesh over MpiComm: sub-groups follow Megatron's rank order") {
  MpiComm c = world();
  const int n = c.size();
  dsp::DeviceMesh mesh(c, dsp::ParallelLayout{.tensor = 2});
  CHECK(mesh.tp_size() == 2);
  CHECK(mesh.dp_size() == n / 2);
  std::vector<std::int32_t> tp{c.rank()}, dp{c.rank()};
  mesh.tensor_group().all_reduce(std::span(tp));
  mesh.data_group().all_reduce(std::span(dp));
  const int tp_rank = c.rank() % 2, dp_rank = c.rank() / 2;
  CHECK(tp[0] == 2 * (2 * dp_rank) + 1);                    // ranks 2 dp and 2 dp + 1
  CHECK(dp[0] == tp_rank * (n / 2) + 2 * (n / 2) * (n / 2 - 1) / 2);  // sum over d of (tp + 2 d)
}

TEST_CASE("argument errors: local checks throw CommError (on every rank alike)") {
  MpiComm c = world();
  const int n = c.size();
  std::vector<float> in(n * 3 + 1), out(3);
  CHECK_THROWS_WITH_AS(c.reduce_scatter(std::span<const float>(in), std::span(out)),
                       doctest::Contains("reduce_scatter: input has"), dsp::CommError);
  CHECK_THROWS_AS(c.reduce_scatter_async(std::span<const float>(in), std::span(out)).wait(), dsp::CommError);
  CHECK_THROWS_WITH_AS(c.all_gather(std::span<const float>(out), std::span(in)),
                       doctest::Contains("all_gather: output has"), dsp::CommError);
  CHECK_THROWS_WITH_AS(c.broadcast(std::span(out), n), doctest::Contains("broadcast: root"), dsp::CommError);
  CHECK_THROWS_AS(c.broadcast_async(std::span(out), -1).wait(), dsp::CommError);
  const std::string self = "send: bad destination rank " + std::to_string(c.rank());
  CHECK_THROWS_WITH_AS(c.send(std::span<const float>(out), c.rank()), self.c_str(), dsp::CommError);
  CHECK_THROWS_AS(c.send_async(std::span<const float>(out), n).wait(), dsp::CommError);
  CHECK_THROWS_WITH_AS(c.send(std::span<const float>(out), (c.rank() + 1) % n, -3), doctest::Contains("tag -3"),
                       dsp::CommError);
  CHECK_THROWS_AS(c.recv(std::span(out), -1), dsp::CommError);
  CHECK_THROWS_AS(c.all_to_all_v(std::span<const float>(out), std::vector<std::int64_t>(n + 1), std::span(out),
                                 std::vector<std::int64_t>(n + 1)),
                  dsp::CommError);
  c.barrier();  // nothing was posted: the communicator is still in step
}

TEST_CASE("counts above INT_MAX are rejected before anything is sent") {
  MpiComm c = world();
  // Address space only (PROT_NONE, never touched): 2^31 bytes and 2^31 int32 elements.
  const std::size_t elems = std::size_t{1} << 31;
  void* mem = mmap(nullptr, elems * sizeof(std::int32_t), PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  REQUIRE(mem != MAP_FAILED);
  std::span<char> bytes(static_cast<char*>(mem), elems);
  std::span<std::int32_t> ints(static_cast<std::int32_t*>(mem), elems);
  CHECK_THROWS_WITH_AS(c.broadcast(bytes, 0), doctest::Contains("exceed MPI's int count limit"), dsp::CommError);
  CHECK_THROWS_WITH_AS(c.all_reduce(ints), doctest::Contains("all_reduce: 2147483648 elements exceed"), dsp::CommError);
  CHECK_THROWS_AS(c.all_reduce_async(ints).wait(), dsp::CommError);
  munmap(mem, elems * sizeof(std::int32_t));
  c.barrier();
}

TEST_CASE("a Work dropped before completion still completes (MpiRuntime waits for it)") {
  MpiComm c = world();
  std::vector<float> x(1000, 1.0f);
  std::vector<bf16> h(10, bf16(1.0f));
  {
    Work dropped = c.all_reduce_async(std::span(x));
    Work dropped_half = c.all_reduce_async(std::span(h));  // its fp32 scratch lives on in Inflight
  }
  std::vector<float> y{1.0f};
  c.all_reduce(std::span(y));  // later collectives are unaffected
  CHECK(y[0] == float(c.size()));
  dsp::comm::detail::Inflight::get().drain();  // what MpiRuntime does before MPI_Finalize
  CHECK(dsp::comm::detail::Inflight::get().size() == 0);
  for (float v : x) CHECK(v == float(c.size()));
  for (bf16 v : h) CHECK(static_cast<float>(v) == 1.0f);  // no write-back without wait()
}

TEST_CASE("MPI errors become CommError with MPI's message (DSP_MPI_CHECK)") {
  MpiComm c = world();
  int v = 0;
  CHECK_THROWS_WITH_AS(DSP_MPI_CHECK(MPI_Send(&v, 1, MPI_INT, c.size() + 5, 0, c.native())),
                       doctest::Contains("MPI_Send failed: MPI_ERR_RANK"), dsp::CommError);
}
