// The warning queue behind offload::warn (see errors.h).
#include <cstdio>
#include <deque>
#include <mutex>

#include "errors.h"

namespace offload {
namespace {

// Bounded, so that a failure repeating in a loop nobody drains cannot grow memory.
constexpr std::size_t kMaxQueued = 1024;

class WarningQueue {
 public:
  ~WarningQueue() {
    // Never drained (the process is exiting): say it on stderr rather than lose it.
    for (const std::string& m : queue_) std::fprintf(stderr, "onnx_offload: warning: %s\n", m.c_str());
    if (dropped_) std::fprintf(stderr, "onnx_offload: warning: %zu more warnings were dropped\n", dropped_);
  }
  void push(const std::string& m) {
    std::lock_guard<std::mutex> g(mu_);
    if (queue_.size() >= kMaxQueued) {
      ++dropped_;
      return;
    }
    queue_.push_back(m);
  }
  std::vector<std::string> take() {
    std::lock_guard<std::mutex> g(mu_);
    std::vector<std::string> out(queue_.begin(), queue_.end());
    queue_.clear();
    if (dropped_) {
      out.push_back(concat(dropped_, " more warnings were dropped: the queue holds ", kMaxQueued));
      dropped_ = 0;
    }
    return out;
  }
  void requeue(std::vector<std::string> ms) {
    std::lock_guard<std::mutex> g(mu_);
    queue_.insert(queue_.begin(), std::make_move_iterator(ms.begin()), std::make_move_iterator(ms.end()));
  }

 private:
  std::mutex mu_;
  std::deque<std::string> queue_;
  std::size_t dropped_ = 0;
};

WarningQueue& queue() {
  static WarningQueue q;
  return q;
}

}  // namespace

void warn(const std::string& message) noexcept {
  try {
    queue().push(message);
  } catch (...) {
    // Out of memory while warning: nothing better to do.
  }
}

std::vector<std::string> take_warnings() { return queue().take(); }

void requeue_warnings(std::vector<std::string> messages) noexcept {
  try {
    queue().requeue(std::move(messages));
  } catch (...) {
  }
}

}  // namespace offload
