// dsp-preprocess-data: JSON lines into Megatron indexed datasets (PREFIX.bin + PREFIX.idx),
// as Megatron-LM's tools/preprocess_data.py writes them and dsp-train --data-path reads them.
// Each line is one document; the text under each --json-keys key is tokenized as one sequence
// (with --append-eod the EOD id ends it) and written to OUTPUT-PREFIX_KEY_document.{bin,idx}
// (Megatron's names). Tokens are uint16 when the vocabulary has fewer than 65500 ids, else
// int32 (Megatron's DType.optimal_dtype). An empty text gives an empty document (no EOD), as
// in Megatron.
//
//   dsp-preprocess-data --input corpus.jsonl --output-prefix data/corpus --append-eod
//   dsp-preprocess-data --input corpus.jsonl --json-keys text title --output-prefix data/c
//             --tokenizer-type HuggingFaceTokenizer --tokenizer-model tokenizer.json --workers 2
//   dsp-train --data-path data/corpus_text_document --vocab-size 257 ...
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <exception>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli.hpp"
#include "dsp/data/indexed_dataset.hpp"
#include "dsp/data/tokenizer.hpp"

namespace {

struct Options {
  std::string input, output_prefix, tokenizer_type = "ByteTokenizer", tokenizer_model;
  std::vector<std::string> json_keys{"text"};
  bool append_eod = false;
  int workers = 1;
  std::size_t chunk_lines = 4096;  // lines tokenized at once (by the workers together)
};

// The texts of one line under each key. Throws InputError naming file:line for a line that is
// not a JSON object or lacks a key, or whose value is not a string.
std::vector<std::string> texts_of(const std::string& line, std::int64_t number, const Options& o) {
  const nlohmann::json doc = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
  DSP_CHECK_AS(dsp::InputError, doc.is_object(), o.input, ":", number,
               ": not a JSON object (or not valid JSON in UTF-8)");
  std::vector<std::string> out;
  for (const auto& key : o.json_keys) {
    const auto it = doc.find(key);
    DSP_CHECK_AS(dsp::InputError, it != doc.end(), o.input, ":", number, ": no key \"", key, "\" (--json-keys)");
    DSP_CHECK_AS(dsp::InputError, it->is_string(), o.input, ":", number, ": \"", key, "\" is not a string");
    out.push_back(it->get<std::string>());
  }
  return out;
}

void preprocess(const Options& o) {
  for (std::size_t k = 0; k < o.json_keys.size(); ++k)
    for (std::size_t j = 0; j < k; ++j)
      DSP_CHECK_AS(dsp::ConfigError, o.json_keys[j] != o.json_keys[k], "--json-keys names '", o.json_keys[k],
                   "' twice (each key writes its own dataset)");
  const dsp::data::Tokenizer tokenizer(o.tokenizer_type, o.tokenizer_model);
  const std::int32_t eod = o.append_eod ? tokenizer.eod() : -1;
  const auto dtype = tokenizer.vocab_size() < 65500 ? dsp::data::TokenDType::uint16 : dsp::data::TokenDType::int32;
  std::ifstream in(o.input, std::ios::binary);
  DSP_CHECK_AS(dsp::InputError, in.good(), "--input '", o.input, "' cannot be opened (missing?)");
  if (const auto dir = std::filesystem::path(o.output_prefix).parent_path(); !dir.empty()) {
    std::error_code ec;  // created as --metrics-file and --save create theirs
    std::filesystem::create_directories(dir, ec);
    DSP_CHECK_AS(dsp::InputError, !ec, "--output-prefix '", o.output_prefix, "': its folder cannot be created (",
                 ec.message(), ")");
  }
  std::vector<std::unique_ptr<dsp::data::IndexedDatasetBuilder>> builders;
  std::vector<std::string> prefixes;
  for (const auto& key : o.json_keys) {
    prefixes.push_back(o.output_prefix + "_" + key + "_document");
    builders.push_back(std::make_unique<dsp::data::IndexedDatasetBuilder>(prefixes.back(), dtype));
  }
  const auto t0 = std::chrono::steady_clock::now();
  std::int64_t line_number = 0, documents = 0, tokens = 0, bytes = 0;
  std::vector<std::string> lines;
  std::vector<std::int64_t> numbers;  // each line's number in --input (for errors)
  std::vector<std::vector<std::vector<std::int32_t>>> ids;  // [line][key] of a chunk
  std::string line;
  bool more = true;
  while (more) {
    lines.clear();
    numbers.clear();
    while (lines.size() < o.chunk_lines && (more = static_cast<bool>(std::getline(in, line)))) {
      ++line_number;
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;  // blank line: no document
      lines.push_back(std::move(line));
      numbers.push_back(line_number);
      bytes += static_cast<std::int64_t>(lines.back().size());
    }
    ids.assign(lines.size(), {});
    std::vector<std::exception_ptr> errors(lines.size());  // per line: the first in the file is reported
    std::vector<std::thread> threads;
    for (int w = 0; w < o.workers; ++w)
      threads.emplace_back([&, w] {
        for (std::size_t i = static_cast<std::size_t>(w); i < lines.size(); i += static_cast<std::size_t>(o.workers)) {
          try {
            for (auto& text : texts_of(lines[i], numbers[i], o)) {
              auto seq = tokenizer.encode(text);
              if (!seq.empty() && eod >= 0) seq.push_back(eod);
              ids[i].push_back(std::move(seq));
            }
          } catch (...) {
            errors[i] = std::current_exception();
            return;  // a later line of this worker cannot come before this one
          }
        }
      });
    for (auto& t : threads) t.join();
    for (const auto& e : errors)
      if (e) std::rethrow_exception(e);
    for (auto& per_key : ids) {
      for (std::size_t k = 0; k < per_key.size(); ++k) {
        if (!per_key[k].empty()) builders[k]->add_item(per_key[k]);
        builders[k]->end_document();
        tokens += static_cast<std::int64_t>(per_key[k].size());
      }
      ++documents;
    }
  }
  for (auto& b : builders) b->finalize();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (const auto& p : prefixes) std::printf("wrote %s.bin and %s.idx\n", p.c_str(), p.c_str());
  std::printf("%lld documents, %lld tokens (%s, vocabulary %d%s) from %.1f MB in %.2f s (%.1f MB/s)\n",
              static_cast<long long>(documents), static_cast<long long>(tokens), o.tokenizer_type.c_str(),
              tokenizer.vocab_size(), o.append_eod ? (", EOD " + std::to_string(eod)).c_str() : "",
              static_cast<double>(bytes) / 1e6, s, static_cast<double>(bytes) / 1e6 / std::max(s, 1e-9));
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"dsp-preprocess-data: JSON lines into Megatron indexed datasets (.bin + .idx) for dsp-train --data-path"};
  Options o;
  samples::path_option(app.add_option("--input", o.input, "JSON lines: one document per line"))->required();
  app.add_option("--json-keys", o.json_keys, "keys of the texts to write, one dataset each (default: text)");
  samples::path_option(app.add_option("--output-prefix", o.output_prefix,
                                      "writes OUTPUT-PREFIX_KEY_document.bin and .idx per key"))
      ->required();
  app.add_flag("--append-eod", o.append_eod, "end every non-empty document with the tokenizer's EOD id");
  app.add_option("--tokenizer-type", o.tokenizer_type, "ByteTokenizer (bytes, EOD 256) or HuggingFaceTokenizer")
      ->check(CLI::IsMember({"ByteTokenizer", "HuggingFaceTokenizer"}));
  samples::path_option(app.add_option("--tokenizer-model", o.tokenizer_model,
                                      "tokenizer.json of a byte-level BPE (with HuggingFaceTokenizer)"));
  app.add_option("--workers", o.workers, "threads tokenizing")->check(samples::at_least(1));
  return samples::run_main(app, argc, argv, [&] { preprocess(o); });
}
