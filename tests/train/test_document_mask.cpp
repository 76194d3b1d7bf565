// Packed documents (model/document_mask.hpp; Megatron-LM's --reset-position-ids,
// --reset-attention-mask, --eod-mask-loss, megatron/core/datasets/gpt_dataset.py
// _get_ltor_masks_and_position_ids): the masks themselves; a packed sequence equals its
// documents run alone; and the trainer's loss, normalised over every loss token of the global
// batch, gives the same update however the batch is split over gradient accumulation,
// micro-batches and data-parallel ranks.
#include <doctest/doctest.h>

#include <cmath>
#include <mutex>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "dsp/backend/host.hpp"
#include "dsp/comm/launch.hpp"
#include "dsp/model/causal_lm.hpp"
#include "dsp/model/document_mask.hpp"
#include "dsp/policy.hpp"
#include "dsp/train/trainer.hpp"
#include "../gather_global.hpp"
#include "../relative_error.hpp"
#include "small_model.hpp"
#include "small_train_config.hpp"

using namespace dsp;

namespace train_document_mask_test {
using P = Policy<backend::Host, comm::ThreadComm>;

namespace {

constexpr std::int32_t kEod = 10;  // '\n' of the byte vocabulary

model::DocumentMaskConfig all_options() { return {true, true, true, kEod}; }

// Documents of the given lengths, each ending in the EOD token (other tokens drawn from
// [11, 127)), then one more token: the packed text, of sum(lengths) + 1 tokens.
std::vector<std::int32_t> packed_text(const std::vector<std::int64_t>& lengths, unsigned seed) {
  std::mt19937 gen(seed);
  std::uniform_int_distribution<std::int32_t> token(11, 126);
  std::vector<std::int32_t> text;
  for (auto len : lengths) {
    for (std::int64_t i = 0; i + 1 < len; ++i) text.push_back(token(gen));
    text.push_back(kEod);
  }
  text.push_back(token(gen));
  return text;
}

model::ModelConfig config64() {
  auto c = test::small_model();
  c.seq_length = 64;
  c.init_method_std = 0.1f;  // attention far from uniform, so a leaked key shows
  return c;
}

}  // namespace

TEST_CASE("document_masks: Megatron's positions, attention starts and loss mask (data = the input tokens)") {
  // Two sequences of 8 inputs; E = EOD. Megatron: loss_mask[data == eod] = 0 (the prediction
  // made at an EOD carries no loss; predicting the EOD does), positions restart after an EOD,
  // attention_mask[(i + 1):, :(i + 1)] = 0 for an EOD at i; each sequence on its own.
  const std::int32_t E = kEod;
  const std::vector<std::int32_t> inputs{20, 21, E, 22, 23, E, 24, 25, /**/ E, 30, 31, 32, E, E, 33, 34};
  const auto m = model::document_masks(inputs, 8, all_options());
  CHECK(m.positions == std::vector<std::int32_t>{0, 1, 2, 0, 1, 2, 0, 1, /**/ 0, 0, 1, 2, 3, 0, 0, 1});
  CHECK(m.key_begin == std::vector<std::int32_t>{0, 0, 0, 3, 3, 3, 6, 6, /**/ 0, 1, 1, 1, 1, 5, 6, 6});
  CHECK(m.document_ids == std::vector<std::int32_t>{0, 0, 0, 1, 1, 1, 2, 2, /**/ 0, 1, 1, 1, 1, 2, 3, 3});
  CHECK(m.loss_mask == std::vector<float>{1, 1, 0, 1, 1, 0, 1, 1, /**/ 0, 1, 1, 1, 0, 0, 1, 1});
  CHECK(model::key_begin_from_document_ids(m.document_ids, 8) == m.key_begin);

  // Each option alone.
  const auto pos_only = model::document_masks(inputs, 8, {true, false, false, E});
  CHECK(pos_only.positions == m.positions);
  CHECK(pos_only.key_begin == std::vector<std::int32_t>(16, 0));
  CHECK(pos_only.loss_mask == std::vector<float>(16, 1.0f));
  const auto mask_only = model::document_masks(inputs, 8, {false, true, false, E});
  CHECK(mask_only.positions == std::vector<std::int32_t>{0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7});
  CHECK(mask_only.key_begin == m.key_begin);

  // Into a forward context: targets -1 where the loss mask is 0; the causal end (mask_positions)
  // is the row once positions restart; none of it without the options.
  auto ctx = model::ForwardContext::for_training(2, 8);
  std::vector<std::int32_t> targets(16, 5);
  model::apply_document_masks(ctx, inputs, targets, all_options());
  CHECK(ctx.positions == m.positions);
  CHECK(ctx.key_begin == m.key_begin);
  CHECK(ctx.mask_positions == std::vector<std::int32_t>{0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7});
  CHECK(targets == std::vector<std::int32_t>{5, 5, -1, 5, 5, -1, 5, 5, -1, 5, 5, 5, -1, -1, 5, 5});
  auto plain = model::ForwardContext::for_training(2, 8);
  std::vector<std::int32_t> untouched(16, 5);
  model::apply_document_masks(plain, inputs, untouched, {});
  CHECK(plain.positions == model::ForwardContext::for_training(2, 8).positions);
  CHECK(!plain.masks_documents());
  CHECK(untouched == std::vector<std::int32_t>(16, 5));

  CHECK_THROWS_AS(model::DocumentMaskConfig({false, true, false, -1}).validate(), ConfigError);
  CHECK_THROWS_AS(model::key_begin_from_document_ids({0, 1, 0, 1}, 4), Error);
}

// One packed sequence of documents of 5, 37 and 22 tokens (each ending in EOD) with all three
// options equals the three documents run as their own sequences: the loss sum over the same 61
// loss tokens (4 + 36 + 21: the prediction at each EOD is masked), divided by 61, and every
// parameter gradient (dloss = 1/61 per token, accumulated over the three runs).
// Tolerance 1e-6 relative: the packed and separate runs do the same arithmetic per document
// (masked probabilities are exactly 0, adding 0 is exact, the softmax of a row is bitwise its
// document's), except that the GEMMs sum over different key / token counts (64 vs 5, 37, 22),
// so BLAS may block and order the fp32 sums differently (~1e-7 relative per product through 2
// layers), and the weight gradients sum 64 tokens in one GEMM instead of three: a few 1e-7
// (measured: gradients 3.7e-7 to 4.1e-7 norm-wise, loss 1.4e-8), under 1e-6. A leaked key of another document, a position not restarted or a loss token
// too many is an O(1e-2) or larger change (checked: the unmasked packed run is far off).
TEST_CASE("a packed sequence of documents (5, 37, 22 tokens) equals the documents run alone: loss and gradients") {
  const std::vector<std::int64_t> lengths{5, 37, 22};
  const auto text = packed_text(lengths, 3);
  const std::int64_t seq = 64;
  for (bool flash : {false, true})
    for (int tp : {1, 2}) {
      CAPTURE(flash);
      CAPTURE(tp);
      auto config = config64();
      config.use_flash_attn = flash;
      comm::launch(tp, [&](comm::ThreadComm& world) {
        DeviceMesh mesh(world, ParallelLayout{.tensor = tp});
        model::CausalLM<P> m(config, mesh, 42);
        const auto grads = [&] {
          std::vector<std::vector<float>> g;
          for (auto* p : m.parameters()) g.emplace_back(p->grad.values().begin(), p->grad.values().end());
          return g;
        };
        auto rel = [](const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
          std::vector<float> fa, fb;
          for (std::size_t i = 0; i < a.size(); ++i) {
            fa.insert(fa.end(), a[i].begin(), a[i].end());
            fb.insert(fb.end(), b[i].begin(), b[i].end());
          }
          return test::relative_error(fa, fb);
        };
        // packed: inputs text[0:64], targets text[1:65]
        auto run_packed = [&](const model::DocumentMaskConfig& dc, double& loss_sum, double& loss_tokens) {
          std::vector<std::int32_t> inputs(text.begin(), text.begin() + seq), targets(text.begin() + 1, text.end());
          auto ctx = model::ForwardContext::for_training(1, seq);
          model::apply_document_masks(ctx, inputs, targets, dc);
          loss_tokens = double(std::count_if(targets.begin(), targets.end(), [](auto t) { return t >= 0; }));
          m.zero_grad();
          model::CausalLM<P>::Activations act;
          const auto loss = m.forward(ctx, inputs, targets, act);
          loss_sum = std::accumulate(loss.begin(), loss.end(), 0.0);
          m.backward(act, std::vector<float>(loss.size(), float(1.0 / loss_tokens)));
          return grads();
        };
        double packed_sum = 0, packed_tokens = 0;
        const auto packed = run_packed(all_options(), packed_sum, packed_tokens);
        REQUIRE(packed_tokens == 61.0);

        // separate: document d alone, its own sequence of its length, the same targets
        m.zero_grad();
        double separate_sum = 0.0, separate_tokens = 0.0;
        std::int64_t start = 0;
        for (auto len : lengths) {
          std::vector<std::int32_t> inputs(text.begin() + start, text.begin() + start + len),
              targets(text.begin() + start + 1, text.begin() + start + len + 1);
          auto ctx = model::ForwardContext::for_training(1, len);
          model::apply_document_masks(ctx, inputs, targets, all_options());
          CHECK(!ctx.masks_documents());  // one document: plain causal attention at positions 0..len-1
          separate_tokens += double(std::count_if(targets.begin(), targets.end(), [](auto t) { return t >= 0; }));
          model::CausalLM<P>::Activations act;
          const auto loss = m.forward(ctx, inputs, targets, act);
          separate_sum += std::accumulate(loss.begin(), loss.end(), 0.0);
          m.backward(act, std::vector<float>(loss.size(), float(1.0 / 61.0)));
          start += len;
        }
        const auto separate = grads();
        CHECK(separate_tokens == 61.0);
        CHECK(std::abs(packed_sum / 61.0 - separate_sum / 61.0) <= 1e-6 * std::abs(separate_sum / 61.0));
        const double grad_error = rel(packed, separate);
        CHECK(grad_error <= 1e-6);

        // Sensitivity: without the attention mask, keys of other documents leak in (far off),
        // and the reset positions then reach RoPE (restarted vs not differ).
        double s = 0, n = 0;
        const auto leaked = run_packed({true, false, true, kEod}, s, n);
        CHECK(rel(leaked, separate) > 1e-3);
        const auto leaked_unreset = run_packed({false, false, true, kEod}, s, n);
        CHECK(rel(leaked_unreset, leaked) > 1e-3);
        // With the mask, RoPE's scores depend only on position differences inside a document,
        // so not restarting the positions changes nothing but rounding (Megatron's flags are
        // independent; this is why the restart alone is checked through the leaked runs above).
        const auto unreset = run_packed({false, true, true, kEod}, s, n);
        CHECK(rel(unreset, separate) <= 1e-5);
        run_packed({true, true, false, kEod}, s, n);
        CHECK(n == 64.0);  // without --eod-mask-loss the predictions at the EODs count again
      });
    }
}

namespace {

// Two packed sequences of 64 inputs (documents 5/37/22 and 20/44), the global batch.
std::vector<std::vector<std::int32_t>> global_batch_texts() {
  return {packed_text({5, 37, 22}, 3), packed_text({20, 44}, 4)};
}

struct LayoutRun {
  std::vector<double> losses;
  std::vector<float> grad_norms;
  std::map<std::string, Tensor> final;
};

// Trains `steps` steps on the same global batch of two sequences at micro-batch size `micro`,
// `dp` data-parallel and `tp` tensor-parallel ranks, handing the trainer explicit micro-batches
// (Trainer::train_step(std::vector<MicroBatch>)). carry: the micro-batches carry positions,
// document ids and the loss mask (computed by document_masks) and the TrainConfig's document
// options are off; otherwise the TrainConfig's options derive them from the EOD tokens.
LayoutRun run_layout(int tp, int dp, std::int64_t micro, bool flash, int steps, bool carry = false) {
  auto config = config64();
  config.use_flash_attn = flash;
  const auto& data = test::shakespeare(config.seq_length);
  auto tc = test::small_train_config(2, steps);
  tc.micro_batch_size = micro;
  if (!carry) {
    tc.reset_position_ids = tc.reset_attention_mask = tc.eod_mask_loss = true;
    tc.eod_token = kEod;
  }
  const auto texts = global_batch_texts();
  LayoutRun out;
  std::mutex mu;
  comm::launch(tp * dp, [&](comm::ThreadComm& world) {
    DeviceMesh mesh(world, ParallelLayout{.tensor = tp, .data = dp});
    train::Trainer<P> trainer(config, tc, mesh, data);
    std::vector<double> losses;
    std::vector<float> norms;
    for (int s = 0; s < steps; ++s) {
      // this DP rank's sequences: 2 / dp of them, in micro-batches of `micro`
      std::vector<train::MicroBatch> mbs;
      const std::int64_t per_rank = 2 / dp;
      for (std::int64_t i = 0; i < per_rank; ++i) {
        if (i % micro == 0) mbs.emplace_back();
        const auto& t = texts[std::size_t(mesh.dp_rank() * per_rank + i)];
        auto& mb = mbs.back();
        mb.inputs.insert(mb.inputs.end(), t.begin(), t.begin() + 64);
        mb.targets.insert(mb.targets.end(), t.begin() + 1, t.end());
        if (carry) {
          const std::vector<std::int32_t> one(t.begin(), t.begin() + 64);
          const auto m = model::document_masks(one, 64, all_options());
          mb.positions.insert(mb.positions.end(), m.positions.begin(), m.positions.end());
          mb.document_ids.insert(mb.document_ids.end(), m.document_ids.begin(), m.document_ids.end());
          mb.loss_mask.insert(mb.loss_mask.end(), m.loss_mask.begin(), m.loss_mask.end());
        }
      }
      const auto r = trainer.train_step(std::move(mbs));
      losses.push_back(r.loss);
      norms.push_back(r.grad_norm);
    }
    std::map<std::string, Tensor> params;
    for (auto* p : trainer.parameters()) params[p->spec.name] = test::gather_global(mesh.tensor_group(), p->spec, p->value);
    std::lock_guard lk(mu);
    if (world.rank() == 0) {
      out.losses = losses;
      out.grad_norms = norms;
      out.final = params;
    }
  });
  return out;
}

}  // namespace

// The same global batch (2 packed sequences, 123 loss tokens) as GA=2 x micro-batch 1,
// GA=1 x micro-batch 2, DP=2 x micro-batch 1, TP=2 and TP=2 x DP=2: the loss of every step and the
// parameters after 3 AdamW steps agree. The loss is the sum over loss tokens / the global count
// (123, counted over every micro-batch and DP rank), so the layouts differ only in fp32
// summation order (a GEMM over 128 vs 64 tokens, the DP all-reduce, TP partial sums):
// ~1e-7 relative in the gradients. Tolerances 1e-6 on the step losses, the gradient norms and
// the parameters after 3 steps (measured: losses <= 1.1e-8, gradient norms equal, parameters
// <= 6.3e-8; Adam's first steps divide by sqrt(v), which could magnify the relative differences
// of near-zero gradient entries, hence not tighter). Micro-batches that carry
// the same positions, document ids and loss mask (TrainConfig options off) give bitwise the
// same run as the options deriving them.
TEST_CASE("document masks: GA=2 x micro 1, GA=1 x micro 2, DP=2 and TP=2 give the same update") {
  for (bool flash : {false, true}) {
    CAPTURE(flash);
    const int steps = 3;
    const LayoutRun ref = run_layout(1, 1, 1, flash, steps);
    REQUIRE(ref.losses.size() == steps);
    struct L {
      int tp, dp;
      std::int64_t micro;
    };
    for (const L l : {L{1, 1, 2}, L{1, 2, 1}, L{2, 1, 2}, L{2, 2, 1}}) {
      CAPTURE(l.tp);
      CAPTURE(l.dp);
      CAPTURE(l.micro);
      const LayoutRun r = run_layout(l.tp, l.dp, l.micro, flash, steps);
      for (int s = 0; s < steps; ++s) {
        CAPTURE(s);
        CHECK(std::abs(r.losses[s] - ref.losses[s]) <= 1e-6 * std::abs(ref.losses[s]));
        CHECK(std::abs(r.grad_norms[s] - ref.grad_norms[s]) <= 1e-6 * std::abs(ref.grad_norms[s]));
      }
      CHECK(test::relative_error(r.final, ref.final) <= 1e-6);
    }
    const LayoutRun carried = run_layout(1, 1, 1, flash, steps, true);
    CHECK(carried.losses == ref.losses);
    CHECK(test::relative_error(carried.final, ref.final) == 0.0);
  }
}

// The first step's loss is Megatron's: sum over loss tokens of the per-token loss / their
// count, the same as the model's forward on the two sequences (same seed, same parameters).
TEST_CASE("document masks: the trainer's step loss is the sum over loss tokens over their global count") {
  auto config = config64();
  const auto texts = global_batch_texts();
  const LayoutRun r = run_layout(1, 1, 2, false, 1);
  comm::launch(1, [&](comm::ThreadComm& world) {
    DeviceMesh mesh(world, ParallelLayout{});
    model::CausalLM<P> m(config, mesh, test::small_train_config(2, 1).seed);
    std::vector<std::int32_t> inputs, targets;
    for (const auto& t : texts) {
      inputs.insert(inputs.end(), t.begin(), t.begin() + 64);
      targets.insert(targets.end(), t.begin() + 1, t.end());
    }
    auto ctx = model::ForwardContext::for_training(2, 64);
    model::apply_document_masks(ctx, inputs, targets, all_options());
    const double count = double(std::count_if(targets.begin(), targets.end(), [](auto t) { return t >= 0; }));
    CHECK(count == 123.0);  // 61 + 62: one masked prediction per EOD input
    model::CausalLM<P>::Activations act;
    const auto loss = m.forward(ctx, inputs, targets, act);
    const double expected = std::accumulate(loss.begin(), loss.end(), 0.0) / count;
    CHECK(std::abs(r.losses[0] - expected) <= 1e-6 * expected);  // fp32 summation order only
  });
}

// The data set's own batches with the options on ('\n' as EOD: Shakespeare's lines are the
// documents): DP=2 and micro-batch 1 give the DP1 micro-batch 2 losses (tolerance 1e-5 as
// test_layout_invariance over 4 steps), the options change the loss, evaluate() applies them,
// and a trainer without an EOD token for them is refused.
TEST_CASE("document masks through train_step() and evaluate() on the data set's batches") {
  auto config = config64();
  const auto& data = test::shakespeare(config.seq_length);
  auto run = [&](int dp, std::int64_t micro, bool options) {
    auto tc = test::small_train_config(4, 4);
    tc.micro_batch_size = micro;
    tc.reset_position_ids = tc.reset_attention_mask = tc.eod_mask_loss = options;
    tc.eod_token = kEod;
    std::vector<double> losses;
    std::mutex mu;
    comm::launch(dp, [&](comm::ThreadComm& world) {
      DeviceMesh mesh(world, ParallelLayout{.data = dp});
      train::Trainer<P> trainer(config, tc, mesh, data);
      std::vector<double> l;
      for (int s = 0; s < 4; ++s) l.push_back(trainer.train_step().loss);
      l.push_back(trainer.evaluate());
      std::lock_guard lk(mu);
      if (world.rank() == 0) losses = l;
    });
    return losses;
  };
  const auto ref = run(1, 2, true);
  for (auto [dp, micro] : {std::pair{2, std::int64_t{1}}, std::pair{1, std::int64_t{1}}}) {
    CAPTURE(dp);
    const auto r = run(dp, micro, true);
    for (std::size_t s = 0; s < ref.size(); ++s) CHECK(std::abs(r[s] - ref[s]) <= 1e-5 * ref[s]);
  }
  const auto off = run(1, 2, false);
  CHECK(std::abs(off[0] - ref[0]) > 1e-3 * ref[0]);
  CHECK(std::abs(off.back() - ref.back()) > 1e-3 * ref.back());

  auto tc = test::small_train_config(4, 1);
  tc.eod_mask_loss = true;  // no eod_token
  comm::launch(1, [&](comm::ThreadComm& world) {
    DeviceMesh mesh(world, ParallelLayout{});
    CHECK_THROWS_AS(train::Trainer<P>(config, tc, mesh, data), ConfigError);
  });
}

TEST_CASE("train_step(micro-batches) refuses a wrong number of micro-batches or wrong sizes") {
  auto config = config64();
  const auto& data = test::shakespeare(config.seq_length);
  auto tc = test::small_train_config(2, 1);
  tc.micro_batch_size = 1;
  comm::launch(1, [&](comm::ThreadComm& world) {
    DeviceMesh mesh(world, ParallelLayout{});
    train::Trainer<P> trainer(config, tc, mesh, data);
    train::MicroBatch mb{std::vector<std::int32_t>(64, 20), std::vector<std::int32_t>(64, 21), {}, {}, {}};
    CHECK_THROWS_AS(trainer.train_step({mb}), Error);  // GA is 2
    train::MicroBatch short_mb = mb;
    short_mb.positions.assign(10, 0);
    CHECK_THROWS_AS(trainer.train_step({mb, short_mb}), Error);
    train::MicroBatch weighted = mb;
    weighted.loss_mask.assign(64, 0.5f);
    CHECK_THROWS_AS(trainer.train_step({mb, weighted}), Error);
    CHECK(trainer.iteration() == 0);
  });
}

}  // namespace train_document_mask_test
