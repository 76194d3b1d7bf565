#pragma once
// ThreadScope: a setting of the calling thread that RAII scopes set and restore (the memory
// space, the matmul precision, batch invariance, packed weights, inference mode). Each setting
// is a class deriving from ThreadScope<itself, T>: its objects are the scopes, and
// Setting::current() reads the value.

namespace dsp {

/// Base of a per-thread setting of type T named by `Tag` (the deriving scope class). While a
/// Tag object lives, its value is the calling thread's setting; at its end the previous value
/// comes back (scopes nest). Outside any scope the value is T{} (false, nullptr, the first
/// enumerator). A scope belongs to one thread's stack; other threads do not see it.
template <class Tag, class T>
class ThreadScope {
 public:
  /// The calling thread's value: the innermost live scope's, T{} outside any.
  static T current() { return slot(); }

  ThreadScope(const ThreadScope&) = delete;
  ThreadScope& operator=(const ThreadScope&) = delete;

 protected:
  explicit ThreadScope(T value) : previous_(slot()) { slot() = value; }
  ~ThreadScope() { slot() = previous_; }

 private:
  static T& slot() {
    thread_local T value{};
    return value;
  }
  T previous_;
};

}  // namespace dsp
