// Test-only, loaded with LD_PRELOAD: stops this process (SIGSTOP) once, at one libc call of
// the CPU kernel's group set-up named by SHM_FAULT_STOP, so that a test can kill it exactly
// there, or let it go on (SIGCONT) to widen a race window:
//   linkat / linkat_after          before / after a segment is named
//   posix_fallocate                before its workspace is allocated
//   flock_ex                       before its owner locks it
//   flock_sh                       after the first shared lock granted (the owner is gone)
// With SHM_FAULT_SUFFIX (e.g. "_1"), linkat stops only for a name that ends with it.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>

static void stop_at(const char* call) {
  static int stopped = 0;
  const char* want = getenv("SHM_FAULT_STOP");
  if (!stopped && want != NULL && strcmp(want, call) == 0) {
    stopped = 1;
    raise(SIGSTOP);
  }
}

static int is_segment(const char* path) {
  const char* suffix = getenv("SHM_FAULT_SUFFIX");
  size_t length = strlen(path), tail = suffix != NULL ? strlen(suffix) : 0;
  return strncmp(path, "/dev/shm/", 9) == 0 && length >= tail && strcmp(path + length - tail, suffix ? suffix : "") == 0;
}

int linkat(int olddirfd, const char* oldpath, int newdirfd, const char* newpath, int flags) {
  int (*real)(int, const char*, int, const char*, int) = dlsym(RTLD_NEXT, "linkat");
  if (is_segment(newpath)) stop_at("linkat");
  int done = real(olddirfd, oldpath, newdirfd, newpath, flags);
  if (is_segment(newpath)) stop_at("linkat_after");
  return done;
}

int posix_fallocate(int fd, off_t offset, off_t len) {
  int (*real)(int, off_t, off_t) = dlsym(RTLD_NEXT, "posix_fallocate");
  stop_at("posix_fallocate");
  return real(fd, offset, len);
}

int posix_fallocate64(int fd, off_t offset, off_t len) {
  int (*real)(int, off_t, off_t) = dlsym(RTLD_NEXT, "posix_fallocate64");
  stop_at("posix_fallocate");
  return real(fd, offset, len);
}

int flock(int fd, int operation) {
  int (*real)(int, int) = dlsym(RTLD_NEXT, "flock");
  if (operation & LOCK_EX) stop_at("flock_ex");
  int done = real(fd, operation);
  if ((operation & LOCK_SH) && done == 0) stop_at("flock_sh");
  return done;
}
