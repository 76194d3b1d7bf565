// dsp-serve: an OpenAI-compatible HTTP server (cpp-httplib) on the serving engine. Loads a
// checkpoint saved at any tensor-, pipeline- and expert-parallel size at the serving TP on one
// pipeline stage, as dsp-generate does, and answers /v1/completions, /v1/chat/completions,
// /v1/models, /health and /metrics (samples/openai_server.hpp) with continuous batching over
// a paged KV cache. Flags in vLLM's spelling.
//
//   dsp-serve --model out/demo/ckpt_tp2 --port 8000
//   curl http://127.0.0.1:8000/v1/completions -d '{"prompt": "ROMEO:", "max_tokens": 64}'
//
// Ranks: threads (ThreadComm) by default; one process each under `mpiexec -n N dsp-serve ...`
// (MpiComm), the HTTP front on rank 0. A rank that fails ends every rank and the server with
// its message. SIGTERM or SIGINT drains: new requests get 503, running and waiting ones finish,
// then the server exits 0; a second signal ends it at once.
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <thread>

#include "cli.hpp"
#include "openai_server.hpp"
#include "ranks.hpp"
#include "serving_flags.hpp"
#include "dsp/backend/host.hpp"
#include "dsp/checkpoint/iterations.hpp"
#include "dsp/checkpoint/model_io.hpp"
#include "dsp/serve/async_engine.hpp"
#include "dsp/serve/engine.hpp"
#include "dsp/train/exit_signal.hpp"

int main(int argc, char** argv) {
  CLI::App app{"dsp-serve: an OpenAI-compatible server for a dsp checkpoint of any training layout"};
  std::string model_dir, served_name;
  samples::HttpOptions http;
  std::int64_t max_queue = 256;
  samples::ServingFlags serving;
  samples::path_option(app.add_option("model,--model", model_dir, "checkpoint directory (saved at any TP/PP/EP)"))->required();
  app.add_option("--served-model-name", served_name, "the model's name in the API (default: --model as given)");
  app.add_option("--host", http.host, "address to listen on");
  app.add_option("--port", http.port, "port to listen on (0: any free port, printed)")->check(CLI::Range(0, 65535));
  app.add_option("--max-queue", max_queue, "requests waiting for a batch slot at most; beyond it 503")->check(samples::at_least(1));
  app.add_option("--api-key", http.api_key, "require 'Authorization: Bearer KEY' on /v1/ (default: no key)");
  serving.add_to(app);
  return samples::run_main(app, argc, argv, [&] {
    const std::string given = model_dir;
    model_dir = dsp::checkpoint::resolve_checkpoint(model_dir).string();  // a folder of iter_* checkpoints: its latest
    const dsp::serve::EngineConfig config = serving.config();
    const auto model_config = dsp::checkpoint::read_model_config(model_dir);
    const auto [tp, ep] = serving.parallel_sizes(model_dir, model_config);
    // Streams open at once: every running and waiting request may hold an HTTP thread.
    http.threads = static_cast<std::size_t>(std::min<std::int64_t>(config.max_num_seqs + max_queue, 1024) + 8);
    const dsp::serve::openai::ServedModel served{served_name.empty() ? given : served_name, model_config.vocab_size,
                                                 config.max_model_len > 0 ? config.max_model_len : model_config.seq_length,
                                                 max_queue};
    dsp::train::ExitSignalHandler signals;  // SIGTERM / SIGINT: drain (rank 0's process acts on it)
    samples::run_ranks(tp * ep, [&]<class Comm>(Comm& world) {
      using P = dsp::Policy<dsp::backend::Host, Comm>;
      using Async = dsp::serve::AsyncEngine<P>;
      const bool driver = world.rank() == 0;
      std::optional<samples::OpenAiServer<Async>> server;  // listening (503) while the model loads
      if (driver) {
        server.emplace(http, served);
        std::fprintf(stderr, "dsp-serve: listening on http://%s:%d (loading %s at TP%d%s)\n", http.host.c_str(),
                     server->port(), model_dir.c_str(), tp, ep > 1 ? (" x EP" + std::to_string(ep)).c_str() : "");
      }
      dsp::DeviceMesh mesh(world, dsp::ParallelLayout{.tensor = tp, .expert = ep});
      const dsp::InferenceMode inference;  // weights only: no gradient buffers
      dsp::model::CausalLM<P> model(model_config, mesh, 0);
      dsp::checkpoint::load_model(model_dir, model);
      dsp::serve::Engine<P> engine(model, world, config);
      Async async(engine, world, {.max_queue = max_queue});
      std::atomic<bool> running{true};
      std::thread watcher;  // rank 0: turns a signal into a drain
      if (driver) {
        std::fprintf(stderr,
                     "dsp-serve: serving '%s': KV cache %lld blocks of %lld tokens per rank (%lld bytes, %s), max model "
                     "len %lld, max num seqs %lld\n",
                     served.name.c_str(), static_cast<long long>(engine.block_manager().num_blocks()),
                     static_cast<long long>(config.block_size), static_cast<long long>(engine.kv_cache_bytes()),
                     std::string(dsp::backend::kv_cache_dtype_name(config.kv_cache_dtype)).c_str(),
                     static_cast<long long>(engine.config().max_model_len), static_cast<long long>(config.max_num_seqs));
        server->serve(async);
        watcher = std::thread([&] {
          while (running && dsp::train::exit_signal_received() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(20));
          if (!running) return;
          const auto st = async.stats();
          std::fprintf(stderr, "dsp-serve: %s: draining (%lld running, %lld waiting); new requests get 503\n",
                       dsp::train::exit_signal_received() == SIGINT ? "SIGINT" : "SIGTERM", static_cast<long long>(st.running),
                       static_cast<long long>(st.waiting));
          async.drain();
        });
      }
      struct Join {  // on every exit from this scope, failure included
        std::atomic<bool>& running;
        std::thread& watcher;
        std::optional<samples::OpenAiServer<Async>>& server;
        ~Join() {
          running = false;
          if (watcher.joinable()) watcher.join();
          if (server) server->stop();  // after the last response: run() returns once all finished
        }
      } join{running, watcher, server};
      async.run();
      if (driver) {
        const auto st = async.stats();
        std::fprintf(stderr, "dsp-serve: stopped after %lld engine steps: %lld prompt and %lld generated tokens, %lld preemptions\n",
                     static_cast<long long>(st.steps), static_cast<long long>(st.prompt_tokens),
                     static_cast<long long>(st.generation_tokens), static_cast<long long>(st.preemptions));
      }
    });
  });
}
