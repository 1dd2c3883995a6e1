// A persistent pool of host worker threads, shared by the CPU kernels of llamarl._C.
#pragma once

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

namespace llamarl {

// A fixed pool of workers; run() hands each worker one task and blocks until all are done.
class ThreadPool {
 public:
  explicit ThreadPool(int n) {
    try {
      for (int i = 0; i < n; ++i) workers_.emplace_back([this, i] { loop(i); });
    } catch (const std::system_error& e) {  // out of threads: stop the ones started, then say so
      stop_all();
      throw std::runtime_error("could not start " + std::to_string(n) + " worker threads (" + e.what() +
                               "); lower the thread count or raise the process/thread limits");
    }
  }
  ~ThreadPool() { stop_all(); }
  int size() const { return static_cast<int>(workers_.size()); }

  void stop_all() {
    {
      std::lock_guard<std::mutex> g(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_)
      if (t.joinable()) t.join();
    workers_.clear();
  }

  // Runs task(i) for i in [0, n) with n <= size(); the caller runs task(0) itself.
  void run(int n, const std::function<void(int)>& task) {
    std::unique_lock<std::mutex> lk(run_mu_);  // one batch at a time
    {
      std::lock_guard<std::mutex> g(mu_);
      task_ = &task;
      active_ = n - 1;
      pending_ = n - 1;
      ++generation_;
    }
    cv_.notify_all();
    task(0);
    std::unique_lock<std::mutex> g(mu_);
    done_cv_.wait(g, [this] { return pending_ == 0; });
    task_ = nullptr;
  }

 private:
  void loop(int idx) {
    uint64_t seen = 0;
    for (;;) {
      const std::function<void(int)>* task;
      {
        std::unique_lock<std::mutex> g(mu_);
        cv_.wait(g, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
        if (idx >= active_) continue;
        task = task_;
      }
      (*task)(idx + 1);
      std::lock_guard<std::mutex> g(mu_);
      if (--pending_ == 0) done_cv_.notify_all();
    }
  }

  std::vector<std::thread> workers_;
  std::mutex mu_, run_mu_;
  std::condition_variable cv_, done_cv_;
  const std::function<void(int)>* task_ = nullptr;
  int active_ = 0, pending_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
};

// The process's shared pool (copy engine, CPU kernels): it grows to the largest thread count asked for;
// a replaced pool stays alive while in use. Defined in copy_cpu.cpp.
std::shared_ptr<ThreadPool> pool_for(int threads);

// fn(begin, end) over [0, units) cut into `threads` contiguous ranges, run on the shared pool (the
// caller's thread takes the first); with threads <= 1 it runs inline, once.
template <class F>
void parallel_ranges(int64_t units, int threads, const F& fn) {
  if (threads <= 1) return fn(int64_t{0}, units);
  const int64_t per = (units + threads - 1) / threads;
  pool_for(threads)->run(threads, [&](int t) {
    const int64_t begin = std::min<int64_t>(units, t * per), end = std::min<int64_t>(units, (t + 1) * per);
    if (begin < end) fn(begin, end);
  });
}

}  // namespace llamarl
