/*
 * Preloaded into QEMU (LD_PRELOAD) for a VM whose RAM is a copy-on-write mapping of a
 * shared, frozen base memory file (memory-backend-file,share=off).
 *
 * Why this exists: QEMU 10's ram_block_discard_range() refuses to discard RAM mapped from
 * a file opened read-only, and for a writable file it punches a hole in the file before
 * MADV_DONTNEED, i.e. it would zero the base under every other VM mapping it. For a
 * private mapping the MADV_DONTNEED alone is what a discard means (the range falls back to
 * the file's pages, which is how Firecracker discards snapshot memory), and it is all a
 * balloon's free-page reporting needs. No QEMU option asks for that, so:
 *
 *   - open() of the path named by AENV_PRIVATE_RAM for writing opens it read-only instead:
 *     the kernel, not QEMU, keeps the base unwritten (the jail also binds it read-only);
 *   - fallocate(PUNCH_HOLE) on such a descriptor succeeds without doing anything, so QEMU
 *     goes on to the MADV_DONTNEED of the private mapping.
 *
 * Everything else passes through. Built by host/vmm/qemu/preload.py.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static int is_base(const char *path)
{
    const char *want = getenv("AENV_PRIVATE_RAM");
    return want != NULL && path != NULL && strcmp(path, want) == 0;
}

/* the same file as AENV_PRIVATE_RAM (by inode: no table of descriptors to go stale) */
static int is_base_fd(int fd)
{
    const char *want = getenv("AENV_PRIVATE_RAM");
    struct stat a, b;
    return want != NULL && fstat(fd, &a) == 0 && stat(want, &b) == 0 &&
           a.st_dev == b.st_dev && a.st_ino == b.st_ino;
}

static int mode_arg(int flags, va_list ap)
{
    return (flags & O_CREAT) || (flags & O_TMPFILE) == O_TMPFILE ? va_arg(ap, int) : 0;
}

static int open_at(int dirfd, const char *path, int flags, int mode)
{
    static int (*real)(int, const char *, int, ...);
    if (real == NULL)
        real = (int (*)(int, const char *, int, ...))dlsym(RTLD_NEXT, "openat");
    if (is_base(path) && (flags & O_ACCMODE) != O_RDONLY)
        return real(dirfd, path, (flags & ~(O_ACCMODE | O_CREAT | O_TRUNC)) | O_RDONLY);
    return real(dirfd, path, flags, mode);
}

int open(const char *path, int flags, ...)
{
    va_list ap;
    va_start(ap, flags);
    int mode = mode_arg(flags, ap);
    va_end(ap);
    return open_at(AT_FDCWD, path, flags, mode);
}

int open64(const char *path, int flags, ...)
{
    va_list ap;
    va_start(ap, flags);
    int mode = mode_arg(flags, ap);
    va_end(ap);
    return open_at(AT_FDCWD, path, flags, mode);
}

int openat(int dirfd, const char *path, int flags, ...)
{
    va_list ap;
    va_start(ap, flags);
    int mode = mode_arg(flags, ap);
    va_end(ap);
    return open_at(dirfd, path, flags, mode);
}

int openat64(int dirfd, const char *path, int flags, ...)
{
    va_list ap;
    va_start(ap, flags);
    int mode = mode_arg(flags, ap);
    va_end(ap);
    return open_at(dirfd, path, flags, mode);
}

/* what _FORTIFY_SOURCE compiles an open() with flags unknown at compile time into */
int __open_2(const char *path, int flags)
{
    return open_at(AT_FDCWD, path, flags, 0);
}

int __open64_2(const char *path, int flags)
{
    return open_at(AT_FDCWD, path, flags, 0);
}

int fallocate(int fd, int mode, off_t offset, off_t len)
{
    static int (*real)(int, int, off_t, off_t);
    if ((mode & FALLOC_FL_PUNCH_HOLE) && is_base_fd(fd))
        return 0;
    if (real == NULL)
        real = (int (*)(int, int, off_t, off_t))dlsym(RTLD_NEXT, "fallocate");
    return real(fd, mode, offset, len);
}

int fallocate64(int fd, int mode, off_t offset, off_t len)
{
    return fallocate(fd, mode, offset, len);
}
