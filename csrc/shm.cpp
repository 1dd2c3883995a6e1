// POSIX shared memory: create / attach / unlink with errors that say what failed and what to do.
#include "shm.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <stdexcept>
#include <string>

namespace llamarl {

namespace {

void check_name(const std::string& name) {
  if (name.size() < 2 || name[0] != '/' || name.find('/', 1) != std::string::npos || name.size() > 250 ||
      name.find('\0') != std::string::npos)  // shm_open would stop at a NUL: another segment's name
    throw std::invalid_argument("shared-memory segment name must look like '/llamarl-...' (one leading '/', "
                                "no other '/', no NUL, at most 250 characters), got '" + name + "'");
}

std::string errno_text(int err) { return std::string(std::strerror(err)) + " (errno " + std::to_string(err) + ")"; }

// Free bytes of the filesystem behind shm_open (Linux: /dev/shm), or -1 if unknown.
int64_t shm_free_bytes() {
  struct statvfs st;
  if (statvfs("/dev/shm", &st) != 0) return -1;
  return static_cast<int64_t>(st.f_bavail) * static_cast<int64_t>(st.f_frsize);
}

uint8_t* map(int fd, int64_t nbytes, const std::string& name) {
  void* p = mmap(nullptr, static_cast<size_t>(nbytes), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  if (p == MAP_FAILED)
    throw std::runtime_error("mmap of shared-memory segment '" + name + "' (" + std::to_string(nbytes) +
                             " bytes) failed: " + errno_text(errno) + "; check the address-space limit (ulimit -v)");
  return static_cast<uint8_t*>(p);
}

}  // namespace

ShmSegment* ShmSegment::create(const std::string& name, int64_t nbytes) {
  check_name(name);
  if (nbytes <= 0) throw std::invalid_argument("shared-memory segment '" + name + "': nbytes must be > 0");
  const int64_t free_b = shm_free_bytes();
  if (free_b >= 0 && nbytes > free_b)
    throw std::runtime_error("cannot create shared-memory segment '" + name + "' of " + std::to_string(nbytes) +
                             " bytes: /dev/shm has only " + std::to_string(free_b) +
                             " bytes free. Enlarge /dev/shm (e.g. docker run --shm-size), free it, or sync "
                             "fewer/smaller weights");
  int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) {
    const int err = errno;
    std::string hint = err == EEXIST ? "; a segment of that name already exists (a leftover from a crashed run? "
                                       "remove /dev/shm" + name + ")"
                                     : "";
    throw std::runtime_error("shm_open(create) of shared-memory segment '" + name + "' failed: " +
                             errno_text(err) + hint);
  }
  int rc = ftruncate(fd, static_cast<off_t>(nbytes));
  if (rc == 0) rc = posix_fallocate(fd, 0, static_cast<off_t>(nbytes));  // returns the error number
  else rc = errno;
  if (rc != 0) {
    close(fd);
    shm_unlink(name.c_str());
    throw std::runtime_error("cannot reserve " + std::to_string(nbytes) + " bytes for shared-memory segment '" +
                             name + "': " + errno_text(rc) +
                             ". Enlarge /dev/shm (e.g. docker run --shm-size) or sync smaller weights");
  }
  uint8_t* data = nullptr;
  try {
    data = map(fd, nbytes, name);
  } catch (...) {
    close(fd);
    shm_unlink(name.c_str());
    throw;
  }
  close(fd);
  return new ShmSegment(name, data, nbytes, /*owner=*/true);
}

ShmSegment* ShmSegment::attach(const std::string& name, int64_t nbytes) {
  check_name(name);
  int fd = shm_open(name.c_str(), O_RDWR, 0);
  if (fd < 0) {
    const int err = errno;
    throw std::runtime_error("cannot attach shared-memory segment '" + name + "': " + errno_text(err) +
                             (err == ENOENT ? "; its owner (the generator rank) has exited or unlinked it, or the "
                                              "handle is from another host/run"
                                            : ""));
  }
  struct stat st;
  if (fstat(fd, &st) != 0) {
    const int err = errno;
    close(fd);
    throw std::runtime_error("fstat of shared-memory segment '" + name + "' failed: " + errno_text(err));
  }
  if (static_cast<int64_t>(st.st_size) != nbytes) {
    close(fd);
    throw std::runtime_error("shared-memory segment '" + name + "' holds " + std::to_string(st.st_size) +
                             " bytes but the handle says " + std::to_string(nbytes) +
                             ": the handle does not belong to this segment (stale handle from another run?)");
  }
  uint8_t* data = nullptr;
  try {
    data = map(fd, nbytes, name);
  } catch (...) {
    close(fd);
    throw;
  }
  close(fd);
  return new ShmSegment(name, data, nbytes, /*owner=*/false);
}

ShmSegment::~ShmSegment() {
  if (data_ != nullptr) munmap(data_, static_cast<size_t>(nbytes_));
}

void ShmSegment::unlink() {
  if (!owner_)
    throw std::runtime_error("shared-memory segment '" + name_ +
                             "' was attached, not created, by this process: only its owner unlinks it");
  if (unlinked_) return;
  shm_unlink_name(name_);
  unlinked_ = true;
}

bool shm_unlink_name(const std::string& name) {
  check_name(name);
  if (shm_unlink(name.c_str()) == 0) return true;
  if (errno == ENOENT) return false;
  throw std::runtime_error("shm_unlink of '" + name + "' failed: " + errno_text(errno));
}

bool pid_alive(int64_t pid) {
  if (pid <= 0) return false;
  if (kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH) return false;
#ifdef __linux__
  // A killed child that its parent has not reaped yet is a zombie: dead for our purposes.
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  if (stat) {
    std::string line;
    std::getline(stat, line);
    const auto close_paren = line.rfind(')');
    if (close_paren != std::string::npos && close_paren + 2 < line.size()) {
      const char state = line[close_paren + 2];
      if (state == 'Z' || state == 'X') return false;
    }
  }
#endif
  return true;
}

}  // namespace llamarl
