// serve::Scheduler's token budgets, checked against the counts worked out by hand: decodes
// first, prompts chunked to what is left of --max-num-batched-tokens, and with
// --prefill-decode-ratio the prompt tokens of a step that carries decodes capped at the ratio
// per decode (at least min_prefill_chunk), while a step without decodes takes the whole budget.
#include <doctest/doctest.h>

#include <deque>
#include <vector>

#include "dsp/serve/scheduler.hpp"

using namespace dsp;

namespace serve_scheduler_test {
using serve::Request;
using serve::ScheduledChunk;

namespace {
// Runs one step: schedules it, marks its chunks computed, and gives every request whose chunk
// reached its end one generated token (a decode from then on).
std::vector<ScheduledChunk> step(serve::Scheduler& s) {
  auto batch = s.schedule();
  s.advance(batch);
  for (auto& c : batch)
    if (c.samples) c.request->output.push_back(1);
  return batch;
}

std::int64_t prompt_tokens(const std::vector<ScheduledChunk>& batch) {
  std::int64_t n = 0;
  for (auto& c : batch)
    if (c.count > 1 || c.first < static_cast<std::int64_t>(c.request->prompt.size())) n += c.count;
  return n;
}

struct Fixture {
  serve::EngineConfig config;
  serve::BlockManager blocks{4096, 16, false};
  std::deque<Request> requests;

  Request& add(serve::Scheduler& s, std::size_t prompt_len) {
    Request& r = requests.emplace_back();
    r.prompt.assign(prompt_len, 7);
    s.add(r);
    return r;
  }
};
}  // namespace

TEST_CASE("scheduler: a step with decodes takes prompt tokens at the ratio per decode, at least 16") {
  Fixture f;
  f.config.max_num_batched_tokens = 2048;
  f.config.prefill_decode_ratio = 1.0;
  serve::Scheduler s(f.config, f.blocks);
  for (int i = 0; i < 24; ++i) f.add(s, 8);
  // No decodes yet: the whole budget, all 24 prompts of 8 tokens (192) in one step.
  CHECK(prompt_tokens(step(s)) == 192);
  // 24 decodes now; a prompt of 100 tokens arrives: 24 of its tokens per step (1 per decode).
  Request& long_prompt = f.add(s, 100);
  auto batch = step(s);
  CHECK(batch.size() == 25);
  CHECK(prompt_tokens(batch) == 24);
  CHECK(long_prompt.computed == 24);
  batch = step(s);
  CHECK(prompt_tokens(batch) == 24);
  CHECK(long_prompt.computed == 48);
}

TEST_CASE("scheduler: with few decodes the prompt budget is min_prefill_chunk; ratio 0 means no cap") {
  for (double ratio : {1.0, 0.0}) {
    CAPTURE(ratio);
    Fixture f;
    f.config.max_num_batched_tokens = 64;
    f.config.prefill_decode_ratio = ratio;
    serve::Scheduler s(f.config, f.blocks);
    f.add(s, 4);
    step(s);  // its prompt: one decode from now on
    Request& b = f.add(s, 100);
    Request& c = f.add(s, 100);
    auto batch = step(s);
    if (ratio == 0.0) {
      CHECK(prompt_tokens(batch) == 63);  // the token budget alone: 64 - 1 decode, all to b
      CHECK(b.computed == 63);
      CHECK(c.status == serve::RequestStatus::Waiting);
    } else {
      CHECK(prompt_tokens(batch) == serve::min_prefill_chunk);
      CHECK(b.computed == serve::min_prefill_chunk);
      CHECK(c.status == serve::RequestStatus::Waiting);  // the prompt budget went to b
    }
  }
}

TEST_CASE("scheduler: the prompt budget is the ratio per decode rounded up; one-token prompts are decodes") {
  Fixture f;
  f.config.max_num_batched_tokens = 2048;
  f.config.prefill_decode_ratio = 0.5;
  serve::Scheduler s(f.config, f.blocks);
  Request& a = f.add(s, 20);
  for (int i = 0; i < 40; ++i) f.add(s, 1);
  // Step 1, no decodes: a's 20 tokens and the 40 one-token prompts.
  CHECK(prompt_tokens(step(s)) == 60);
  // 41 decodes; a prompt of 50 arrives. The cap is ceil(0.5 * 41) = 21 tokens.
  Request& d = f.add(s, 50);
  auto batch = step(s);
  CHECK(d.computed == 21);
  CHECK(batch.size() == 42);  // 41 decodes + d's chunk
  CHECK(a.output.size() == 2);
}

TEST_CASE("engine config: a negative or non-finite --prefill-decode-ratio is refused, naming the value") {
  serve::EngineConfig c;
  c.prefill_decode_ratio = -1.0;
  CHECK_THROWS_WITH_AS(c.validate(), doctest::Contains("--prefill-decode-ratio must be >= 0"), ConfigError);
  c.prefill_decode_ratio = 0.0;
  CHECK_NOTHROW(c.validate());
}

}  // namespace serve_scheduler_test
