/* A file system with a fixed latency per request, for the storage benchmark: every open() of a path under
 * SLOWOPEN_PREFIX sleeps SLOWOPEN_US microseconds first, then opens the file as usual. Reads, mmap and the page
 * cache are untouched, so each format pays the same latency per request (one per image for a folder, one per
 * shard for shards), as on NFS or Lustre where each open is a round trip, or on object storage where each file
 * is a GET. Built by benchmarks/storage.py; loaded with LD_PRELOAD into train.py and its DataLoader workers. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static void pay(const char *path) {
    const char *prefix = getenv("SLOWOPEN_PREFIX");
    const char *us = getenv("SLOWOPEN_US");
    if (!path || !prefix || !us || strncmp(path, prefix, strlen(prefix)) != 0) return;
    long micros = atol(us);
    struct timespec delay = {micros / 1000000, (micros % 1000000) * 1000};
    while (nanosleep(&delay, &delay) != 0) {}
}

#define WRAP(name, ...)                                                                 \
    int name(const char *path, int flags, ...) {                                        \
        static int (*real)(const char *, int, ...) = 0;                                 \
        if (!real) real = dlsym(RTLD_NEXT, #name);                                      \
        mode_t mode = 0;                                                                \
        if (flags & (O_CREAT | O_TMPFILE)) { va_list ap; va_start(ap, flags); mode = va_arg(ap, int); va_end(ap); } \
        pay(path);                                                                      \
        return real(path, flags, mode);                                                 \
    }
WRAP(open)
WRAP(open64)

#define WRAPAT(name)                                                                    \
    int name(int dirfd, const char *path, int flags, ...) {                             \
        static int (*real)(int, const char *, int, ...) = 0;                            \
        if (!real) real = dlsym(RTLD_NEXT, #name);                                      \
        mode_t mode = 0;                                                                \
        if (flags & (O_CREAT | O_TMPFILE)) { va_list ap; va_start(ap, flags); mode = va_arg(ap, int); va_end(ap); } \
        pay(path);                                                                      \
        return real(dirfd, path, flags, mode);                                          \
    }
WRAPAT(openat)
WRAPAT(openat64)
