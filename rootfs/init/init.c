/*
 * aenv-init: PID 1 of an aenv guest. Static, no dependencies (gcc -static -Os).
 *
 *  - mounts /proc /sys /dev (devtmpfs) /dev/pts /dev/shm /run; /tmp stays on the root disk
 *    (a tmpfs only with the "ro" flag); envd's TMPDIR is /var/lib/aenv-envd
 *  - hostname from aenv.hostname= (kernel command line; also written to /etc/hostname and
 *    /etc/hosts) or /etc/hostname
 *  - brings lo up and configures the NIC from the kernel command line:
 *      aenv.ip=ADDR/PREFIX  aenv.gw=GW  aenv.dns=IP[,IP]  aenv.iface=eth0
 *    aenv.ip=none skips it; without aenv.ip the QEMU user-network defaults are used
 *    (10.0.2.15/24, gw 10.0.2.2, dns 10.0.2.3) when the interface exists.
 *  - starts /usr/bin/envd as root (ENVD_SET_CLOCK=1), output on the console,
 *    restarts it with backoff when it dies; aenv.envd=PATH overrides the binary
 *  - aenv.growfs: grows the root ext4 to its device (status in /run/aenv/growfs)
 *  - reaps orphans
 *  - SIGTERM/SIGINT/SIGPWR (or a write to /run/aenv/shutdown): sync, stop all processes,
 *    unmount, remount / read-only, power off. SIGUSR1: the same, then reboot.
 * Console lines start with "aenv-init: ".
 *
 * A builder (a root holding BUILDER_MARK: host/runtime/builder.py): init and envd move into
 * a tmpfs root and the disk is let go, so a snapshot of the running VM can be restored on
 * any image's disk (same size); there `aenv-init switch-root [--growfs]`, run as root
 * through envd, mounts /dev/vda and pivots every process onto it (envd unpacked itself
 * under /run, which moves along): a template build's VM without a cold boot of envd.
 *
 * Called as aenv-exec (a symlink), it is envd's credential switch instead:
 *   aenv-exec ERRFD UID GID GROUPS PATH ARG0 [ARG...]
 * setgroups(GROUPS: comma-separated, may be empty), setgid, setuid, then execv(PATH).
 * If any step fails it writes the errno (a native int) to ERRFD and exits 127; ERRFD is
 * close-on-exec, so a successful exec closes it with nothing written. envd spawns it with
 * vfork: a Python process cannot switch credentials in a vfork child, and a full fork of
 * envd costs ~20 ms per command in a TCG guest.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <net/if.h>
#include <net/route.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/reboot.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <linux/fs.h>
#include <sys/sysmacros.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define ENVD_DEFAULT "/usr/bin/envd"
#define SHUTDOWN_FIFO "/run/aenv/shutdown"
#define ENVD_TMPDIR "/var/lib/aenv-envd"
#define GROWFS_STATUS "/run/aenv/growfs"
#define EXT4_IOC_RESIZE_FS _IOW('f', 16, unsigned long long)
#define BUILDER_MARK "/etc/aenv/builder"
#define BUILDER_TMPDIR "/run/aenv/envd"   /* moves with /run onto the image at switch-root */
#define NEW_ROOT "/newroot"
#define BUILDER_READY "/run/aenv/builder"  /* "ready": on its tmpfs root, the disk let go */
#define ROOT_DEV "/dev/vda"

static char cmdline[4096];

static double uptime(void) {
    struct timespec ts;
    clock_gettime(CLOCK_BOOTTIME, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static void say(const char *fmt, ...) {
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    dprintf(2, "aenv-init: [%.3f] %s\n", uptime(), buf);
}

static void read_cmdline(void) {
    int fd = open("/proc/cmdline", O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
        ssize_t n = read(fd, cmdline, sizeof cmdline - 1);
        cmdline[n > 0 ? n : 0] = 0;
        close(fd);
    }
}

/* Value of KEY=... on the kernel command line (copied into out), or NULL. */
static const char *param(const char *key, char *out, size_t n) {
    size_t kl = strlen(key);
    const char *p = cmdline;
    while (*p) {
        while (*p == ' ' || *p == '\n') p++;
        const char *end = p;
        while (*end && *end != ' ' && *end != '\n') end++;
        if ((size_t)(end - p) > kl && strncmp(p, key, kl) == 0 && p[kl] == '=') {
            size_t vl = end - p - kl - 1;
            if (vl >= n) vl = n - 1;
            memcpy(out, p + kl + 1, vl);
            out[vl] = 0;
            return out;
        }
        p = end;
    }
    return NULL;
}

static int has_flag(const char *word) {
    size_t wl = strlen(word);
    const char *p = cmdline;
    while ((p = strstr(p, word))) {
        if ((p == cmdline || p[-1] == ' ') && (p[wl] == 0 || p[wl] == ' ' || p[wl] == '\n'))
            return 1;
        p += wl;
    }
    return 0;
}

static void do_mount(const char *src, const char *dst, const char *type, unsigned long flags,
                     const char *data) {
    mkdir(dst, 0755);
    if (mount(src, dst, type, flags, data) < 0 && errno != EBUSY)
        say("mount %s on %s failed: %s", type, dst, strerror(errno));
}

static void write_file(const char *path, const char *text) {
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) return;
    if (write(fd, text, strlen(text)) < 0) say("write %s: %s", path, strerror(errno));
    close(fd);
}

static void setup_mounts(void) {
    const unsigned long nosuid_nodev_noexec = MS_NOSUID | MS_NODEV | MS_NOEXEC;
    do_mount("proc", "/proc", "proc", nosuid_nodev_noexec, NULL);
    do_mount("sysfs", "/sys", "sysfs", nosuid_nodev_noexec, NULL);
    do_mount("devtmpfs", "/dev", "devtmpfs", MS_NOSUID, "mode=0755");
    do_mount("devpts", "/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC, "gid=5,mode=0620,ptmxmode=0666");
    do_mount("tmpfs", "/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777");
    do_mount("tmpfs", "/run", "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755");
    symlink("/proc/self/fd", "/dev/fd");
    symlink("/proc/self/fd/0", "/dev/stdin");
    symlink("/proc/self/fd/1", "/dev/stdout");
    symlink("/proc/self/fd/2", "/dev/stderr");
    mkdir("/run/lock", 01777);
    mkdir("/run/aenv", 0755);
    /* root must be writable (the kernel command line should say rw) */
    if (!has_flag("ro") && mount(NULL, "/", NULL, MS_REMOUNT, NULL) < 0)
        say("remount / rw failed: %s", strerror(errno));
}

/* after the command line is read (the "ro" flag) */
static void setup_tmp(void) {
    /* /tmp is on the sandbox disk, as on E2B (agents unpack archives and pip-install
       there; a tmpfs costs guest RAM and is capped at half of it); a tmpfs only when
       the root is read-only */
    if (has_flag("ro")) {
        do_mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, "mode=1777");
    } else {
        mkdir("/tmp", 01777);
        if (chmod("/tmp", 01777) < 0) say("chmod /tmp: %s", strerror(errno));
    }
    /* envd (a frozen one-file executable) unpacks itself under its TMPDIR: on the disk
       (no guest RAM), outside the user's /tmp, root only */
    mkdir("/var", 0755);
    mkdir("/var/lib", 0755);  /* not in every imported image */
    mkdir(ENVD_TMPDIR, 0700);
}

/* aenv.growfs: the root filesystem grown to its (bigger) device before anything runs: the
   kernel's online resize (EXT4_IOC_RESIZE_FS; resize2fs cannot: / is busy), here rather
   than by a program in the guest (an image may have none, and starting one costs seconds
   under emulation). The outcome goes to GROWFS_STATUS ("grown BLOCKS" or "failed: ...")
   for the host to read. */
static void grow_fs(const char *root) {
    char status[160], why[140] = "";
    unsigned long long blocks = 0;
    struct stat st;
    struct statvfs sv;
    int fd = open(root, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0 || fstat(fd, &st) < 0 || fstatvfs(fd, &sv) < 0 || sv.f_frsize == 0) {
        snprintf(why, sizeof why, "stat /: %s", strerror(errno));
    } else {
        char path[64], buf[32] = "";
        snprintf(path, sizeof path, "/sys/dev/block/%u:%u/size", major(st.st_dev), minor(st.st_dev));
        int sfd = open(path, O_RDONLY | O_CLOEXEC);
        ssize_t n = sfd >= 0 ? read(sfd, buf, sizeof buf - 1) : -1;
        if (sfd >= 0) close(sfd);
        unsigned long long sectors = n > 0 ? strtoull(buf, NULL, 10) : 0;
        blocks = sectors * 512 / sv.f_frsize;
        if (sectors == 0)
            snprintf(why, sizeof why, "size of %s unknown", path);
        else if (ioctl(fd, EXT4_IOC_RESIZE_FS, &blocks) < 0)
            snprintf(why, sizeof why, "resize to %llu blocks: %s", blocks, strerror(errno));
    }
    if (fd >= 0) close(fd);
    if (why[0]) snprintf(status, sizeof status, "failed: %s", why);
    else snprintf(status, sizeof status, "grown %llu", blocks);
    say("growfs: %s", status);
    strncat(status, "\n", sizeof status - strlen(status) - 1);
    write_file(GROWFS_STATUS, status);
}

static void grow_root(void) {
    if (has_flag("aenv.growfs")) grow_fs("/");
}

static void setup_hostname(void) {
    char name[256] = "";
    if (param("aenv.hostname", name, sizeof name) && name[0]) {
        /* keep /etc/hostname and /etc/hosts in line (sudo resolves the hostname) */
        char buf[600];
        snprintf(buf, sizeof buf, "%s\n", name);
        write_file("/etc/hostname", buf);
        snprintf(buf, sizeof buf,
                 "127.0.0.1\tlocalhost\n127.0.1.1\t%s\n::1\t\tlocalhost ip6-localhost ip6-loopback\n",
                 name);
        write_file("/etc/hosts", buf);
    } else {
        FILE *f = fopen("/etc/hostname", "re");
        if (f) {
            if (!fgets(name, sizeof name, f)) name[0] = 0;
            fclose(f);
        }
        name[strcspn(name, "\r\n ")] = 0;
    }
    if (!name[0]) strcpy(name, "aenv");
    if (sethostname(name, strlen(name)) < 0) say("sethostname: %s", strerror(errno));
}

static int if_up(int s, const char *ifname) {
    struct ifreq ifr = {0};
    strncpy(ifr.ifr_name, ifname, IFNAMSIZ - 1);
    if (ioctl(s, SIOCGIFFLAGS, &ifr) < 0) return -1;
    ifr.ifr_flags |= IFF_UP | IFF_RUNNING;
    return ioctl(s, SIOCSIFFLAGS, &ifr);
}

static int set_addr(int s, const char *ifname, unsigned long req, in_addr_t a) {
    struct ifreq ifr = {0};
    struct sockaddr_in *sin = (struct sockaddr_in *)&ifr.ifr_addr;
    strncpy(ifr.ifr_name, ifname, IFNAMSIZ - 1);
    sin->sin_family = AF_INET;
    sin->sin_addr.s_addr = a;
    return ioctl(s, req, &ifr);
}

static void write_resolv(char *dns);

/* the nameservers setup_network writes: aenv.dns, or user networking's */
static void network_dns(char *dns, size_t n) {
    char ip[64];
    if (!param("aenv.ip", ip, sizeof ip)) snprintf(dns, n, "10.0.2.3");
    param("aenv.dns", dns, n);
}

static void setup_network(void) {
    int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (s < 0) { say("socket: %s", strerror(errno)); return; }
    if (if_up(s, "lo") < 0) say("lo up: %s", strerror(errno));

    char ip[64], gw[64] = "", dns[256] = "", ifname[IFNAMSIZ] = "eth0";
    param("aenv.iface", ifname, sizeof ifname);
    int explicit_ip = param("aenv.ip", ip, sizeof ip) != NULL;
    if (explicit_ip && strcmp(ip, "none") == 0) { close(s); return; }
    if (!explicit_ip) {
        strcpy(ip, "10.0.2.15/24");
        strcpy(gw, "10.0.2.2");
    }
    param("aenv.gw", gw, sizeof gw);
    network_dns(dns, sizeof dns);

    if (if_nametoindex(ifname) == 0) {
        if (explicit_ip) say("network: no interface %s", ifname);
        close(s);
        return;
    }
    int prefix = 24;
    char *slash = strchr(ip, '/');
    if (slash) { *slash = 0; prefix = atoi(slash + 1); }
    struct in_addr addr, gwa;
    if (inet_pton(AF_INET, ip, &addr) != 1 || prefix < 0 || prefix > 32) {
        say("network: bad aenv.ip %s", ip);
        close(s);
        return;
    }
    in_addr_t mask = prefix ? htonl(0xffffffffu << (32 - prefix)) : 0;
    if (set_addr(s, ifname, SIOCSIFADDR, addr.s_addr) < 0 ||
        set_addr(s, ifname, SIOCSIFNETMASK, mask) < 0 ||
        if_up(s, ifname) < 0) {
        say("network: configuring %s failed: %s", ifname, strerror(errno));
        close(s);
        return;
    }
    if (gw[0]) {
        if (inet_pton(AF_INET, gw, &gwa) != 1) {
            say("network: bad aenv.gw %s", gw);
        } else {
            struct rtentry rt = {0};
            struct sockaddr_in *d = (struct sockaddr_in *)&rt.rt_dst;
            struct sockaddr_in *g = (struct sockaddr_in *)&rt.rt_gateway;
            struct sockaddr_in *m = (struct sockaddr_in *)&rt.rt_genmask;
            d->sin_family = g->sin_family = m->sin_family = AF_INET;
            g->sin_addr = gwa;
            rt.rt_flags = RTF_UP | RTF_GATEWAY;
            rt.rt_dev = ifname;
            if (ioctl(s, SIOCADDRT, &rt) < 0 && errno != EEXIST)
                say("network: default route via %s: %s", gw, strerror(errno));
        }
    }
    close(s);
    write_resolv(dns);
    say("network: %s %s/%d gw %s", ifname, ip, prefix, gw[0] ? gw : "-");
}

/* /etc/resolv.conf of the nameservers in DNS (comma-separated; modified) */
static void write_resolv(char *dns) {
    if (dns[0]) {
        char buf[512] = "", *save = NULL;
        for (char *tok = strtok_r(dns, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
            strncat(buf, "nameserver ", sizeof buf - strlen(buf) - 1);
            strncat(buf, tok, sizeof buf - strlen(buf) - 1);
            strncat(buf, "\n", sizeof buf - strlen(buf) - 1);
        }
        /* /etc/resolv.conf may be a symlink into /run */
        unlink("/etc/resolv.conf");
        write_file("/etc/resolv.conf", buf);
    }
}

static sigset_t handled;
static char envd_path[256] = ENVD_DEFAULT;
static char envd_tmpdir[64] = "TMPDIR=" ENVD_TMPDIR;

static pid_t start_envd(void) {
    pid_t pid = fork();
    if (pid < 0) { say("fork: %s", strerror(errno)); return -1; }
    if (pid == 0) {
        sigprocmask(SIG_UNBLOCK, &handled, NULL);
        setsid();
        int fd = open("/dev/console", O_RDWR | O_NOCTTY);
        if (fd >= 0) { dup2(fd, 1); dup2(fd, 2); if (fd > 2) close(fd); }
        fd = open("/dev/null", O_RDONLY);
        if (fd >= 0) { dup2(fd, 0); if (fd > 2) close(fd); }
        chdir("/");
        char *argv[] = {envd_path, NULL};
        char *envp[] = {
            "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME=/root", "USER=root", "LOGNAME=root", "LANG=C.UTF-8", "TERM=xterm",
            "ENVD_SET_CLOCK=1", envd_tmpdir, NULL,
        };
        execve(envd_path, argv, envp);
        dprintf(2, "aenv-init: exec %s: %s\n", envd_path, strerror(errno));
        _exit(127);
    }
    say("envd started pid %d", (int)pid);
    return pid;
}

static void reap_all_wait(double seconds) {
    double end = uptime() + seconds;
    while (uptime() < end) {
        pid_t p = waitpid(-1, NULL, WNOHANG);
        if (p < 0 && errno == ECHILD) return;
        if (p <= 0) usleep(20000);
    }
}

static void shutdown_now(int cmd) {
    say("shutting down (%s)", cmd == RB_AUTOBOOT ? "reboot" : "power off");
    sync();
    kill(-1, SIGTERM);
    reap_all_wait(3.0);
    kill(-1, SIGKILL);
    reap_all_wait(1.0);
    sync();
    const char *mnts[] = {"/tmp", "/dev/shm", "/dev/pts", "/run", NULL};
    for (int i = 0; mnts[i]; i++) umount2(mnts[i], MNT_DETACH);
    if (mount(NULL, "/", NULL, MS_REMOUNT | MS_RDONLY, NULL) < 0)
        say("remount / ro: %s", strerror(errno));
    sync();
    reboot(cmd);
    say("reboot(): %s; halting", strerror(errno));
    reboot(RB_HALT_SYSTEM);
    for (;;) pause();
}

static int exec_as(int argc, char **argv) {
    if (argc < 7) {
        fprintf(stderr, "usage: aenv-exec ERRFD UID GID GROUPS PATH ARG0 [ARG...]\n");
        return 2;
    }
    int errfd = atoi(argv[1]);
    fcntl(errfd, F_SETFD, FD_CLOEXEC);
    gid_t groups[256];
    size_t n = 0;
    for (char *p = argv[4]; *p && n < sizeof groups / sizeof *groups;) {
        char *end;
        unsigned long g = strtoul(p, &end, 10);
        if (end == p) break;
        groups[n++] = (gid_t)g;
        p = *end == ',' ? end + 1 : end;
    }
    if (setgroups(n, groups) == 0 && setgid((gid_t)strtoul(argv[3], NULL, 10)) == 0 &&
        setuid((uid_t)strtoul(argv[2], NULL, 10)) == 0)
        execv(argv[5], argv + 6);
    int e = errno;
    if (write(errfd, &e, sizeof e) < 0) { /* nothing left to report it to */ }
    _exit(127);
}

static int copy_file(const char *src, const char *dst, mode_t mode) {
    int in = open(src, O_RDONLY | O_CLOEXEC), rc = 0;
    if (in < 0) return -1;
    int out = open(dst, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, mode);
    if (out < 0) { close(in); return -1; }
    char buf[1 << 16];
    ssize_t n;
    while ((n = read(in, buf, sizeof buf)) > 0) {
        for (ssize_t done = 0; done < n;) {
            ssize_t w = write(out, buf + done, n - done);
            if (w < 0) { n = -1; break; }
            done += w;
        }
        if (n < 0) break;
    }
    if (n < 0) rc = -1;
    close(in);
    if (close(out) < 0) rc = -1;
    return rc;
}

/* /proc /sys /dev (with /dev/pts, /dev/shm) and /run moved under TO */
static int move_mounts(const char *to) {
    const char *mnts[] = {"/proc", "/sys", "/dev", "/run", NULL};
    char dst[256];
    for (int i = 0; mnts[i]; i++) {
        snprintf(dst, sizeof dst, "%s%s", to, mnts[i]);
        mkdir(dst, 0755);
        if (mount(mnts[i], dst, NULL, MS_MOVE, NULL) < 0) {
            say("move %s to %s: %s", mnts[i], dst, strerror(errno));
            return -1;
        }
    }
    return 0;
}

/* every process whose root was / gets NEW_ROOT; the old root at PUT_OLD (under it) */
static int pivot_into(const char *new_root, const char *put_old) {
    if (chdir(new_root) < 0 || syscall(SYS_pivot_root, ".", put_old) < 0) {
        say("pivot_root %s: %s", new_root, strerror(errno));
        return -1;
    }
    if (chdir("/") < 0) say("chdir /: %s", strerror(errno));
    return 0;
}

/* A builder's boot: init and envd copied into a tmpfs that becomes the root; init starts
   again from it ("--builder") and unmounts the disk. Returns only if that failed. */
static void builder_root(void) {
    if (mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID, "mode=0755") < 0) {
        say("builder: tmpfs: %s", strerror(errno));
        return;
    }
    const char *dirs[] = {"/tmp/usr", "/tmp/usr/sbin", "/tmp/usr/bin", "/tmp/etc", "/tmp/root",
                          "/tmp/tmp", "/tmp" NEW_ROOT, "/tmp/oldroot", NULL};
    for (int i = 0; dirs[i]; i++) mkdir(dirs[i], 0755);
    chmod("/tmp/tmp", 01777);
    if (copy_file("/proc/self/exe", "/tmp/usr/sbin/aenv-init", 0755) < 0 ||
        copy_file(envd_path, "/tmp/usr/bin/envd", 0755) < 0) {
        say("builder: copying init and envd: %s", strerror(errno));
        return;
    }
    if (symlink("aenv-init", "/tmp/usr/sbin/aenv-exec") < 0) say("builder: aenv-exec: %s", strerror(errno));
    write_file("/tmp/etc/passwd", "root:x:0:0:root:/root:/bin/sh\n");
    write_file("/tmp/etc/group", "root:x:0:\n");
    if (move_mounts("/tmp") < 0 || pivot_into("/tmp", "oldroot") < 0) return;
    char *args[] = {"aenv-init", "--builder", NULL};
    execv("/usr/sbin/aenv-init", args);
    say("builder: exec: %s", strerror(errno));
}

/* `aenv-init switch-root [--growfs]` in a builder (run as root through envd): ROOT_DEV
   mounted, grown, the mounts moved onto it, every process pivoted onto it, then what a
   boot on it would have written (its /tmp, hostname, resolv.conf). */
static int switch_root(int argc, char **argv) {
    read_cmdline();
    if (access(BUILDER_READY, F_OK) < 0) {  /* a root on a disk: no other may go there */
        say("switch-root: not a builder (no %s)", BUILDER_READY);
        return 1;
    }
    int fd = open(ROOT_DEV, O_RDONLY | O_CLOEXEC);  /* nothing the builder's disk left cached */
    if (fd >= 0) {
        if (ioctl(fd, BLKFLSBUF, 0) < 0) say("flush %s: %s", ROOT_DEV, strerror(errno));
        close(fd);
    }
    if (mount(ROOT_DEV, NEW_ROOT, "ext4", 0, NULL) < 0) {
        say("switch-root: mount %s: %s", ROOT_DEV, strerror(errno));
        return 1;
    }
    if (argc > 2 && strcmp(argv[2], "--growfs") == 0) grow_fs(NEW_ROOT);
    if (move_mounts(NEW_ROOT) < 0) return 1;
    mkdir(NEW_ROOT "/run/aenv/oldroot", 0700);
    if (pivot_into(NEW_ROOT, "run/aenv/oldroot") < 0) return 1;
    if (umount2("/run/aenv/oldroot", MNT_DETACH) < 0) say("detach the old root: %s", strerror(errno));
    rmdir("/run/aenv/oldroot");
    unlink(BUILDER_READY);  /* on the disk now: a second switch-root is refused */
    setup_tmp();
    setup_hostname();
    char dns[256] = "";
    network_dns(dns, sizeof dns);
    write_resolv(dns);
    say("switched onto %s", ROOT_DEV);
    return 0;
}

int main(int argc, char **argv) {
    const char *self = strrchr(argv[0], '/');
    if (strcmp(self ? self + 1 : argv[0], "aenv-exec") == 0) return exec_as(argc, argv);
    if (argc > 1 && strcmp(argv[1], "switch-root") == 0) return switch_root(argc, argv);
    int builder = argc > 1 && strcmp(argv[1], "--builder") == 0;  /* in its tmpfs root */
    if (getpid() != 1) fprintf(stderr, "aenv-init: warning: not PID 1\n");
    umask(022);
    if (!builder) setup_mounts();  /* /proc first: the command line lives there */
    read_cmdline();
    say(builder ? "starting a builder" : "starting");
    param("aenv.envd", envd_path, sizeof envd_path);
    if (!builder && access(BUILDER_MARK, F_OK) == 0) builder_root();  /* returns on failure */
    if (builder) {
        strcpy(envd_path, ENVD_DEFAULT);  /* copied there */
        /* the disk let go whole: a mount of another disk on it later must not meet
           this filesystem (a detached one would still hold the device) */
        if (umount2("/oldroot", 0) < 0) {  /* not ready then: the host saves no builder */
            say("builder: unmounting the disk: %s", strerror(errno));
            umount2("/oldroot", MNT_DETACH);
        } else {
            write_file(BUILDER_READY, "ready\n");
        }
        mkdir(BUILDER_TMPDIR, 0700);
        snprintf(envd_tmpdir, sizeof envd_tmpdir, "TMPDIR=%s", BUILDER_TMPDIR);
    } else {
        grow_root();
        setup_tmp();
    }
    reboot(RB_DISABLE_CAD); /* Ctrl-Alt-Del becomes SIGINT to us */
    setup_hostname();
    setup_network();

    struct rlimit rl = {65536, 65536};
    setrlimit(RLIMIT_NOFILE, &rl);

    sigemptyset(&handled);
    int sigs[] = {SIGCHLD, SIGTERM, SIGINT, SIGPWR, SIGUSR1, SIGHUP, SIGQUIT};
    for (size_t i = 0; i < sizeof sigs / sizeof *sigs; i++) sigaddset(&handled, sigs[i]);
    sigprocmask(SIG_BLOCK, &handled, NULL);

    /* shutdown request channel: any write to the FIFO powers off */
    mkfifo(SHUTDOWN_FIFO, 0600);
    int ctl = open(SHUTDOWN_FIFO, O_RDWR | O_NONBLOCK | O_CLOEXEC);

    /* Sleep until a signal or a shutdown request arrives: no periodic wake-up (an idle
     * guest's every timer costs the host CPU under emulation); a timeout only while an
     * envd restart is pending. */
    int sfd = signalfd(-1, &handled, SFD_CLOEXEC);
    pid_t envd = start_envd();
    double started = uptime(), restart_at = -1;
    int failures = 0;
    for (;;) {
        int sig = 0;
        if (sfd >= 0) {
            struct pollfd pf[2] = {{sfd, POLLIN, 0}, {ctl, POLLIN, 0}};
            int wait_ms = restart_at >= 0 ? 100 : -1;
            if (poll(pf, ctl >= 0 ? 2 : 1, wait_ms) > 0 && (pf[0].revents & POLLIN)) {
                struct signalfd_siginfo si;
                if (read(sfd, &si, sizeof si) == sizeof si) sig = (int)si.ssi_signo;
            }
        } else {  /* no signalfd: poll signals once a second as before */
            struct timespec tmo = {restart_at >= 0 ? 0 : 1, restart_at >= 0 ? 100 * 1000 * 1000 : 0};
            siginfo_t si;
            sig = sigtimedwait(&handled, &si, &tmo);
        }
        if (sig == SIGTERM || sig == SIGINT || sig == SIGPWR || sig == SIGQUIT) shutdown_now(RB_POWER_OFF);
        if (sig == SIGUSR1) shutdown_now(RB_AUTOBOOT);
        if (ctl >= 0) {
            char b[16];
            if (read(ctl, b, sizeof b) > 0) shutdown_now(strncmp(b, "reboot", 6) ? RB_POWER_OFF : RB_AUTOBOOT);
        }
        int status;
        pid_t p;
        while ((p = waitpid(-1, &status, WNOHANG)) > 0) {
            if (p != envd) continue;
            double ran = uptime() - started;
            if (WIFEXITED(status)) say("envd pid %d exited with %d after %.1fs", p, WEXITSTATUS(status), ran);
            else say("envd pid %d killed by signal %d after %.1fs", p, WTERMSIG(status), ran);
            failures = ran > 30 ? 1 : failures + 1;
            double delay = 0.1;
            for (int i = 1; i < failures && delay < 5; i++) delay *= 2;
            if (delay > 5) delay = 5;
            restart_at = uptime() + delay;
            envd = -1;
        }
        if (envd < 0 && restart_at >= 0 && uptime() >= restart_at) {
            restart_at = -1;
            started = uptime();
            envd = start_envd();
            if (envd < 0) restart_at = uptime() + 1;
        }
    }
}
