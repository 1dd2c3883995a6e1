// POSIX shared-memory segments for host weight buckets and sync control blocks.
//
// A segment is created by exactly one owner process (shm_open O_CREAT|O_EXCL, then posix_fallocate so
// that a /dev/shm too small for it fails here with ENOSPC instead of a SIGBUS at the first write) and
// attached by name by its peers. Both sides mmap it MAP_SHARED and close the descriptor at once; the
// mapping lives until the ShmSegment is destroyed. Only the owner unlinks the name (`unlink`, also run
// by the Python side at exit and by its reaper process after a crash); unlinking never invalidates
// existing mappings, it only makes the name unreachable for new attachers.
#pragma once

#include <cstdint>
#include <string>

namespace llamarl {

class ShmSegment {
 public:
  // Throws std::runtime_error naming the segment, the failed call and what to do.
  static ShmSegment* create(const std::string& name, int64_t nbytes);
  static ShmSegment* attach(const std::string& name, int64_t nbytes);
  ~ShmSegment();
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;

  // Removes the name (owner only; idempotent). The mapping stays valid.
  void unlink();
  uint8_t* data() const { return data_; }
  int64_t nbytes() const { return nbytes_; }
  const std::string& name() const { return name_; }
  bool owner() const { return owner_; }
  bool unlinked() const { return unlinked_; }

 private:
  ShmSegment(std::string name, uint8_t* data, int64_t nbytes, bool owner)
      : name_(std::move(name)), data_(data), nbytes_(nbytes), owner_(owner) {}
  std::string name_;
  uint8_t* data_;
  int64_t nbytes_;
  bool owner_;
  bool unlinked_ = false;
};

// Removes a segment name; returns false if it did not exist (any other failure throws).
bool shm_unlink_name(const std::string& name);

// True while `pid` names a live (not zombie) process on this host.
bool pid_alive(int64_t pid);

}  // namespace llamarl
