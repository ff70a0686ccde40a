#include "threadpool.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <sched.h>

#include <cstdlib>

namespace specc {

namespace {
inline void cpu_relax() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}
constexpr int kSpins = 1 << 16;  // pause instructions before a worker sleeps: longer than the gap between two layers
}

ThreadPool::ThreadPool(int threads) {
  for (int i = 1; i < threads; ++i) workers_.emplace_back([this, i] { work(i); });
}

ThreadPool::~ThreadPool() {
  stop_ = true;
  {
    std::lock_guard<std::mutex> lock(sleep_mutex_);
    generation_.fetch_add(1);
  }
  wake_.notify_all();
  for (auto& t : workers_) t.join();
}

void ThreadPool::run(int tasks, const std::function<void(int)>& fn) {
  std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
  if (!busy.owns_lock() || tasks <= 1 || workers_.empty()) {
    for (int i = 0; i < tasks; ++i) fn(i);
    return;
  }
  job_ = &fn;
  tasks_ = tasks;
  pending_.store(static_cast<int>(workers_.size()));
  {
    std::lock_guard<std::mutex> lock(sleep_mutex_);
    generation_.fetch_add(1, std::memory_order_release);
  }
  wake_.notify_all();
  for (int i = 0; i < tasks; i += size()) fn(i);
  while (pending_.load(std::memory_order_acquire) > 0) cpu_relax();
}

void ThreadPool::work(int index) {
  uint64_t seen = 0;
  for (;;) {
    int spins = 0;
    while (generation_.load(std::memory_order_acquire) == seen && ++spins < kSpins) cpu_relax();
    if (generation_.load(std::memory_order_acquire) == seen) {
      std::unique_lock<std::mutex> lock(sleep_mutex_);
      wake_.wait(lock, [&] { return generation_.load() != seen; });
    }
    seen = generation_.load(std::memory_order_acquire);
    if (stop_) return;
    for (int i = index; i < tasks_; i += size()) (*job_)(i);
    pending_.fetch_sub(1, std::memory_order_acq_rel);
  }
}

ThreadPool& shared_pool() {
  static ThreadPool pool([] {
    const char* env = std::getenv("SPECC_KERNEL_THREADS");
    cpu_set_t cpus;
    const int usable = sched_getaffinity(0, sizeof(cpus), &cpus) == 0 ? CPU_COUNT(&cpus) : 1;
    const int n = env ? std::atoi(env) : usable;
    return n > 0 ? n : 1;
  }());
  return pool;
}

}  // namespace specc
