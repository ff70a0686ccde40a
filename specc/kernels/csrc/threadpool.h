// A small persistent pool for the kernels: ONNX Runtime calls a custom operator on one of its threads and offers
// no parallel-for through the ABI this library uses, so the operator splits its columns over threads of its own.
// Workers spin briefly between calls (a model's layers follow each other within microseconds), then sleep.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace specc {

class ThreadPool {
 public:
  explicit ThreadPool(int threads);
  ~ThreadPool();
  int size() const { return static_cast<int>(workers_.size()) + 1; }
  // fn(0) .. fn(tasks - 1), task 0 on the calling thread; returns when all are done. A call made while another
  // runs (two sessions at once) runs every task on its own thread.
  void run(int tasks, const std::function<void(int)>& fn);

 private:
  void work(int index);
  std::vector<std::thread> workers_;
  std::mutex busy_, sleep_mutex_;
  std::condition_variable wake_;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};
  std::atomic<bool> stop_{false};
  const std::function<void(int)>* job_ = nullptr;
  int tasks_ = 0;
};

ThreadPool& shared_pool();

}  // namespace specc
