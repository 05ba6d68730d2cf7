// A team: the threads of one OpenMP region kept for a whole decode step, so that each of the
// step's ~150 parallel kernels costs a spin handshake instead of a fork and a join.
//
// Team::run(lead) runs lead() on the calling thread while the region's other threads wait,
// spinning, for work; kvloop::parallel_for called from lead() hands each of them its share of
// the range and returns once every share is done (outside a team it is at::parallel_for).
// NOTE: measured on the 2-core Zen 4 VM (docs/native-kernels.md): an empty
// at::parallel_for cost 1.7-2.0 µs back to back, ~0.26 ms of a 4.2 ms one-row 4-bit step
// (120 products, 30 attentions, the LM head).
// kvloop::parallel_tiles (a product's tiles) lets a thread done with its share take pieces of
// the others' (Team::split_shared).
// NOTE: the shares are at::parallel_for's (the same chunks to the same thread numbers), so a
// kernel computes the same bits in a team or not; parallel_tiles' ranges compute each index
// alone, so which thread takes it does not change its bits either.
// NOTE: no team where the threads outnumber the CPUs this process may run on: a spinning
// thread would then hold the CPU a thread with work needs (a step 20-40x slower at 3 and 4
// threads on 2 CPUs in review); the kernels then fork and join as before. The affinity mask
// counts, not a cgroup CPU quota (torch's default thread count ignores one too: where a
// quota is below the CPUs, set the threads to it, e.g. OMP_NUM_THREADS).
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <omp.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>

namespace kvloop {

class Team {
 public:
  // Runs lead() on this thread with the other threads of an OpenMP region of
  // at::get_num_threads() serving its parallel_for calls; rethrows what lead() throws.
  // Returns the team's size (1: no team, lead() alone on this thread).
  template <typename Lead>
  static int64_t run(Lead&& lead);

  // The team this thread leads, or null.
  static Team* current() { return led_; }

  // fn(begin, end) over [begin, end) in the shares of at::parallel_for(begin, end, grain):
  // share 0 on this (the leading) thread, the others on the waiting ones.
  template <typename Fn>
  void split(int64_t begin, int64_t end, int64_t grain, const Fn& fn);

  // split's shares, except that each thread takes its own in pieces (a quarter of what is
  // left, at least one index) and, done with it, takes pieces from the back of the others'.
  // A thread's part of a job is then its pieces of any share. For ranges whose every index
  // is computed alone: the same whichever thread takes it and wherever the range is cut
  // (nothing carried from one index to the next within a call of fn).
  template <typename Fn>
  void split_shared(int64_t begin, int64_t end, int64_t grain, const Fn& fn);

 private:
  struct Job {
    void (*call)(const void* fn, int64_t begin, int64_t end) = nullptr;
    const void* fn = nullptr;
    int64_t begin = 0, end = 0, chunk = 0, shares = 0;
    bool shared = false;  // split_shared's: shares claimed in pieces, the rest stolen
  };

  // What is left of a share of split_shared, [lo, hi) packed as lo << 32 | hi; a line each.
  struct alignas(64) Left {
    std::atomic<uint64_t> range{0};
  };

  // Spins until ``flag`` differs from ``seen`` (yielding the CPU after a while, so a thread
  // that lost its core to another process gets it back).
  template <typename T>
  static T wait_change(const std::atomic<T>& flag, T seen) {
    for (int64_t spins = 0;; ++spins) {
      const T now = flag.load(std::memory_order_acquire);
      if (now != seen) return now;
      if (spins < (1 << 16)) {
        _mm_pause();
      } else {
        sched_yield();
      }
    }
  }

  // Runs share ``share`` of the job, an exception kept for the lead (the first one) instead
  // of leaving the thread.
  void run_share(int64_t share) {
    const int64_t b = job_.begin + share * job_.chunk;
    if (share >= job_.shares || b >= job_.end) return;
    try {
      job_.call(job_.fn, b, std::min(job_.end, b + job_.chunk));
    } catch (...) {
      const std::lock_guard<std::mutex> lock(error_mutex_);
      if (!error_) error_ = std::current_exception();
    }
  }

  // Takes a piece of share ``share``: from its front (its own thread) or its back. Returns
  // false when none is left.
  bool take(int64_t share, bool front, int64_t& b, int64_t& e) {
    std::atomic<uint64_t>& range = left_[share].range;
    uint64_t r = range.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t lo = static_cast<int64_t>(r >> 32), hi = static_cast<int64_t>(r & 0xffffffffu);
      if (lo >= hi) return false;
      const int64_t n = std::max<int64_t>(1, (hi - lo) / 4);
      b = front ? lo : hi - n;
      e = b + n;
      const uint64_t next = front ? static_cast<uint64_t>(e) << 32 | static_cast<uint64_t>(hi)
                                  : static_cast<uint64_t>(lo) << 32 | static_cast<uint64_t>(b);
      if (range.compare_exchange_weak(r, next, std::memory_order_relaxed)) return true;
    }
  }

  // split_shared's part for thread ``tid``: its own share from the front (if it has one),
  // then the others' from their backs.
  void run_shared(int64_t tid) {
    try {
      int64_t b = 0, e = 0;
      for (int64_t k = 0; k < job_.shares; ++k) {
        const int64_t share = (tid + k) % job_.shares;
        const bool own = share == tid;
        while (take(share, own, b, e)) job_.call(job_.fn, b, e);
      }
    } catch (...) {
      const std::lock_guard<std::mutex> lock(error_mutex_);
      if (!error_) error_ = std::current_exception();
    }
  }

  // NOTE: at::parallel_for's shares: as many threads as grains (at most the team), each a
  // run of ceil(range / threads).
  int64_t share_count(int64_t range, int64_t grain) const {
    const int64_t per = std::max<int64_t>(grain, 1);
    return std::min<int64_t>(size_, (range + per - 1) / per);
  }

  template <typename Fn>
  static Job job_of(const Fn& fn, int64_t begin, int64_t end, int64_t shares, bool shared) {
    return Job{[](const void* f, int64_t b, int64_t e) { (*static_cast<const Fn*>(f))(b, e); },
               &fn, begin, end, (end - begin + shares - 1) / shares, shares, shared};
  }

  // Hands ``job`` to the waiting threads, runs the lead's part, waits for every other part
  // and rethrows the first exception.
  void dispatch(const Job& job) {
    job_ = job;
    const int64_t target = done_.load(std::memory_order_relaxed) + (size_ - 1);
    generation_.fetch_add(1, std::memory_order_release);
    // NOTE: not the team's lead while running its part: a parallel_for inside the job then
    // runs serially (as at::parallel_for inside a parallel region), not as a second job.
    led_ = nullptr;
    if (job.shared) {
      run_shared(0);
    } else {
      run_share(0);
    }
    led_ = this;
    // NOTE: every part is waited for, thrown or not: the job's frames outlive its parts.
    for (int64_t seen = done_.load(std::memory_order_acquire); seen != target;)
      seen = wait_change(done_, seen);
    if (error_) {
      std::exception_ptr error = nullptr;
      std::swap(error, error_);
      std::rethrow_exception(error);
    }
  }

  void serve(int64_t tid) {
    uint64_t seen = 0;
    for (;;) {
      seen = wait_change(generation_, seen);
      if (quit_) return;
      if (job_.shared) {
        run_shared(tid);
      } else {
        run_share(tid);
      }
      done_.fetch_add(1, std::memory_order_acq_rel);
    }
  }

  // The CPUs this process may run on (its affinity mask), at least 1.
  static int64_t usable_cpus() {
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) != 0) return 1;
    return std::max(1, CPU_COUNT(&set));
  }

  static inline thread_local Team* led_ = nullptr;

  int64_t size_ = 1;
  Job job_;
  std::unique_ptr<Left[]> left_;  // one per thread
  bool quit_ = false;
  std::mutex error_mutex_;
  std::exception_ptr error_;  // a part's first exception, rethrown by dispatch on the lead
  alignas(64) std::atomic<uint64_t> generation_{0};  // bumped once a job (or quit_) is set
  alignas(64) std::atomic<int64_t> done_{0};  // parts finished by the waiting threads (one
                                              // a thread a job)
};

template <typename Lead>
int64_t Team::run(Lead&& lead) {
  const int threads = at::get_num_threads();
  if (threads <= 1 || omp_in_parallel() || threads > usable_cpus()) {
    lead();
    return 1;
  }
  Team team;
  // NOTE: allocated before the region (which may have fewer threads, never more): nothing
  // that can throw runs in it outside lead()'s try.
  team.left_ = std::make_unique<Left[]>(threads);
  std::exception_ptr error;
#pragma omp parallel num_threads(threads)
  {
    const int tid = omp_get_thread_num();
    if (tid == 0) {
      // NOTE: every thread of the region has started its body by the time the first job
      // is read (each reads generation_ only after it has started), and the size is the
      // region's real one (OpenMP may give fewer threads than asked).
      team.size_ = omp_get_num_threads();
      led_ = &team;
      try {
        lead();
      } catch (...) {
        error = std::current_exception();
      }
      led_ = nullptr;
      team.quit_ = true;
      team.generation_.fetch_add(1, std::memory_order_release);
    } else {
      team.serve(tid);
    }
  }
  if (error) std::rethrow_exception(error);
  return team.size_;
}

template <typename Fn>
void Team::split(int64_t begin, int64_t end, int64_t grain, const Fn& fn) {
  if (begin >= end) return;
  const int64_t shares = share_count(end - begin, grain);
  if (shares <= 1) {
    fn(begin, end);
    return;
  }
  dispatch(job_of(fn, begin, end, shares, false));
}

template <typename Fn>
void Team::split_shared(int64_t begin, int64_t end, int64_t grain, const Fn& fn) {
  const int64_t shares = begin < end ? share_count(end - begin, grain) : 0;
  // NOTE: a share's bounds are packed in 32 bits each.
  if (shares <= 1 || begin < 0 || end >= (int64_t{1} << 31)) {
    split(begin, end, grain, fn);
    return;
  }
  const Job job = job_of(fn, begin, end, shares, true);
  for (int64_t s = 0; s < shares; ++s) {
    const int64_t b = std::min(end, begin + s * job.chunk), e = std::min(end, b + job.chunk);
    left_[s].range.store(static_cast<uint64_t>(b) << 32 | static_cast<uint64_t>(e),
                         std::memory_order_relaxed);
  }
  dispatch(job);
}

// at::parallel_for, or inside a team (Team::run) its handshake: the kernels' entry to
// threads (with parallel_tiles).
template <typename Fn>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const Fn& fn) {
  if (Team* team = Team::current()) {
    team->split(begin, end, grain, fn);
  } else {
    at::parallel_for(begin, end, grain, fn);
  }
}

// parallel_for for a product's tiles, or any range whose every index is computed alone (see
// Team::split_shared): inside a team, the shares are taken in pieces, so that a thread that
// falls behind (descheduled, or slower to get its bytes) has the rest of its share taken.
// NOTE: measured on the 2-core Zen 4 VM (docs/native-kernels.md): in one
// process, a one-row decode step's layers 0.95x the time of split's fixed shares in
// bfloat16, 0.975x in int4; served (where the HTTP side and the client take CPU time during
// the steps), a bfloat16 step of one stream 8.2-8.6 ms against 9.4-11.7.
template <typename Fn>
inline void parallel_tiles(int64_t begin, int64_t end, int64_t grain, const Fn& fn) {
  Team* team = Team::current();
  if (team == nullptr) return parallel_for(begin, end, grain, fn);  // NOTE: no team here
  team->split_shared(begin, end, grain, fn);
}

}  // namespace kvloop
