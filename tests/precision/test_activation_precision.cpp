// 16-bit activations (precision/activation_precision.hpp): rounding is bf16's / fp16's conversion,
// packing stores 2 bytes per element (measured by the memory counters) and unpacking gives the
// rounded values back exactly, in order, empty tensors included; a whole model's training
// forward keeps exactly half the fp32 bytes (every kept tensor is packed), and its loss moves by
// the rounding only.
#include <doctest/doctest.h>

#include <cmath>
#include <numeric>
#include <utility>
#include <vector>

#include "dsp/backend/host.hpp"
#include "dsp/comm/launch.hpp"
#include "dsp/core/dtype.hpp"
#include "dsp/core/memory.hpp"
#include "dsp/core/memory_space.hpp"
#include "dsp/precision/activation_precision.hpp"
#include "dsp/model/causal_lm.hpp"
#include "dsp/parallel/device_mesh.hpp"
#include "dsp/policy.hpp"
#include "../guarded_space.hpp"

using namespace dsp;

namespace model_activation_precision_test {
using precision::ActivationPrecision;

namespace {

Tensor ramp(Shape shape) {
  Tensor t(std::move(shape));
  for (std::int64_t i = 0; i < t.numel(); ++i) t[i] = std::sin(0.37f * static_cast<float>(i)) * 1000.0f + 1.0f / 3.0f;
  return t;
}

}  // namespace

TEST_CASE("round_activations is the 16-bit conversion, and nothing in fp32") {
  const Tensor x = ramp({5, 7});
  for (ActivationPrecision p : {ActivationPrecision::Fp32, ActivationPrecision::Bf16, ActivationPrecision::Fp16}) {
    Tensor r = x;
    precision::round_activations(backend::Host{}, p, r);
    for (std::int64_t i = 0; i < x.numel(); ++i) {
      const float want = p == ActivationPrecision::Bf16   ? static_cast<float>(bf16(x[i]))
                         : p == ActivationPrecision::Fp16 ? static_cast<float>(fp16(x[i]))
                                                          : x[i];
      CHECK(r[i] == want);
    }
  }
}

TEST_CASE("PackedTensors keeps 2 bytes per element and gives rounded values back exactly") {
  for (ActivationPrecision p : {ActivationPrecision::Bf16, ActivationPrecision::Fp16}) {
    memory::CategoryScope scope(memory::Category::Activations);
    Tensor a = ramp({4, 8}), empty, b = ramp({3});
    precision::round_activations(backend::Host{}, p, a);
    precision::round_activations(backend::Host{}, p, b);
    const Tensor a0 = a, b0 = b;
    const std::int64_t before = memory::snapshot()[memory::Category::Activations].live;
    precision::PackedTensors packed;
    packed.pack(backend::Host{}, p, {&a, &empty, &b});
    CHECK(a.numel() == 0);
    CHECK(b.numel() == 0);
    CHECK(before - memory::snapshot()[memory::Category::Activations].live == (32 + 3) * 2);  // 4 -> 2 bytes
    Tensor a2, empty2, b2;  // the tensors may have moved: unpack by position
    packed.unpack(backend::Host{}, {&a2, &empty2, &b2});
    CHECK(a2.shape() == a0.shape());
    CHECK(a2.values() == a0.values());
    CHECK(b2.values() == b0.values());
    CHECK(empty2.numel() == 0);
    CHECK(memory::snapshot()[memory::Category::Activations].live == before);  // a2, b2 in place of a, b
  }
  Tensor x = ramp({2});
  const Tensor x0 = x;
  precision::PackedTensors fp32;
  fp32.pack(backend::Host{}, ActivationPrecision::Fp32, {&x});
  CHECK(x.values() == x0.values());  // fp32: nothing packed
  precision::PackedTensors bad;
  bad.pack(backend::Host{}, ActivationPrecision::Bf16, {&x});
  Tensor y, z;
  CHECK_THROWS_AS(bad.unpack(backend::Host{}, {&y, &z}), Error);
}

TEST_CASE("in a memory space the packed tensors are 16-bit buffers there, made and read by the backend's convert ops") {
  for (ActivationPrecision p : {ActivationPrecision::Bf16, ActivationPrecision::Fp16}) {
    test::GuardedSpace space;
    Tensor host = ramp({4, 8});
    const Tensor raw = host;
    precision::round_activations(backend::Host{}, p, host);
    {
      MemorySpaceScope in_space(&space);
      memory::CategoryScope scope(memory::Category::Activations);
      Tensor a = host.to(&space), rounded = raw.to(&space);
      precision::round_activations(backend::Host{}, p, rounded);  // in the space: the host's rounding
      CHECK(rounded.to_host().values() == host.values());
      const std::int64_t before = space.counters[memory::Category::Activations].live;
      precision::PackedTensors packed;
      packed.pack(backend::Host{}, p, {&a});
      CHECK(before - space.counters[memory::Category::Activations].live == 32 * 2);  // 4 -> 2 bytes, in the space
      Tensor back;
      packed.unpack(backend::Host{}, {&back});
      CHECK(back.space() == &space);
      CHECK(back.to_host().values() == host.values());
    }
    CHECK(space.counters.total.live == 0);
  }
}

namespace {

using P = Policy<backend::Host, comm::ThreadComm>;

// Bytes a training forward of one micro-batch (2 x 32 tokens) keeps (the Activations category's
// live bytes after it, less before), and its mean loss.
std::pair<std::int64_t, double> kept_by_forward(model::CausalLM<P>& m, ActivationPrecision p) {
  const auto& c = m.config();
  std::vector<std::int32_t> ids(64), targets(64);
  for (int i = 0; i < 64; ++i) {
    ids[static_cast<std::size_t>(i)] = (7 * i + 3) % static_cast<int>(c.vocab_size);
    targets[static_cast<std::size_t>(i)] = (5 * i + 1) % static_cast<int>(c.vocab_size);
  }
  auto ctx = model::ForwardContext::for_training(2, 32);
  ctx.activations = p;
  memory::CategoryScope scope(memory::Category::Activations);
  const std::int64_t before = memory::snapshot()[memory::Category::Activations].live;
  model::CausalLM<P>::Activations act;
  const auto loss = m.forward(ctx, ids, targets, act);
  const std::int64_t kept = memory::snapshot()[memory::Category::Activations].live - before;
  m.backward(act, std::vector<float>(loss.size(), 1.0f / 64.0f));  // unpacks and runs: must not throw
  return {kept, std::accumulate(loss.begin(), loss.end(), 0.0) / 64.0};
}

}  // namespace

TEST_CASE("a 16-bit training forward keeps exactly half the activation bytes of an fp32 one, dense and MoE, TP 1 and 2") {
  model::ModelConfig dense{.vocab_size = 37, .hidden_size = 16, .num_layers = 2, .num_attention_heads = 4,
                           .num_query_groups = 2, .ffn_hidden_size = 24, .seq_length = 32, .init_method_std = 0.3f};
  model::ModelConfig moe = dense;
  moe.num_experts = 4;
  moe.moe_router_topk = 2;
  moe.moe_ffn_hidden_size = 8;
  moe.num_shared_experts = 1;
  moe.first_k_dense_replace = 1;
  for (const auto& config : {dense, moe})
    for (int tp : {1, 2}) {
      CAPTURE(config.is_moe());
      CAPTURE(tp);
      comm::launch(tp, [&](comm::ThreadComm& world) {
        DeviceMesh mesh(world, ParallelLayout{.tensor = tp});
        model::CausalLM<P> m(config, mesh, 42);
        const auto [fp32, fp32_loss] = kept_by_forward(m, ActivationPrecision::Fp32);
        // Statistics stay fp32 at any precision: every RMSNorm's rstd (two per layer and the
        // final norm) and the loss's row max and sum of exp, [64 tokens] each.
        const std::int64_t stats = 4 * 64 * (2 * config.num_layers + 1) + 2 * 4 * 64;
        for (ActivationPrecision p : {ActivationPrecision::Bf16, ActivationPrecision::Fp16}) {
          const auto [half, loss] = kept_by_forward(m, p);
          CHECK(fp32 > stats);
          CHECK((half - stats) * 2 == fp32 - stats);
          CHECK(std::abs(loss - fp32_loss) < 0.02 * fp32_loss);  // 16-bit rounding of the activations
          CHECK(loss != fp32_loss);                               // ... which did happen
        }
      });
    }
}

}  // namespace model_activation_precision_test
