#pragma once
// The chat template of dsp's byte-level models: how POST /v1/chat/completions turns a list of
// messages into the prompt text the model continues.
//
// dsp's demo models learn plain text (tiny Shakespeare: a speaker's name in capitals, a colon,
// a newline, the speech, a blank line), and have no special tokens. The template writes a
// conversation the same way, one block per message, and ends with the assistant's heading:
//
//   SYSTEM:\n{content}\n\n        (role "system" or "developer")
//   USER:\n{content}\n\n
//   ASSISTANT:\n{content}\n\n
//   ASSISTANT:\n                  (the generation prompt, always added)
//
// The model's reply runs until max_tokens or a stop string; a client that wants one speech
// passes "stop": ["\n\n"]. A model trained on other text can be served through
// /v1/completions with the prompt formatted by the client.
#include <string>
#include <string_view>
#include <vector>

namespace dsp::serve {

/// One chat message: role (system, developer, user or assistant) and its text.
struct ChatMessage {
  std::string role;
  std::string content;
};

/// True for the roles the template knows: system, developer, user, assistant.
inline bool is_chat_role(std::string_view role) {
  return role == "system" || role == "developer" || role == "user" || role == "assistant";
}

/// The prompt text of `messages` under the template above. Roles are taken as given
/// (is_chat_role is the caller's check).
inline std::string chat_prompt(const std::vector<ChatMessage>& messages) {
  std::string prompt;
  for (const auto& m : messages) {
    const std::string_view heading = m.role == "user" ? "USER" : m.role == "assistant" ? "ASSISTANT" : "SYSTEM";
    prompt.append(heading).append(":\n").append(m.content).append("\n\n");
  }
  prompt.append("ASSISTANT:\n");
  return prompt;
}

}  // namespace dsp::serve
