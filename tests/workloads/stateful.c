/*
 * hermit-stateful: the stateful workload of Hermit's migration tests and benchmarks.
 *
 * Its state lives in memory and in kernel objects that CRIU must carry over:
 * an in-memory counter (never re-read from disk), a log fd opened once in append
 * mode, a listening TCP socket, a child process connected over a pipe and a
 * socketpair, a worker thread, an SQLite database (WAL) kept open on the workspace,
 * and an optional block of patterned memory that is verified continuously.
 *
 * Every tick it checks its own invariants and, when one is broken, prints one line
 * on stderr naming it and exits with a distinct code (see usage()):
 *   memory    the patterned memory is intact (rolling check)                     -> 3
 *   child     the background child is alive (pipe and socketpair still open)      -> 4
 *   threads   the worker thread's counter keeps advancing                        -> 5
 *   seq       the child echoes the socketpair sequence numbers exactly in order  -> 6
 *   db        SELECT count(*), min(n), max(n) matches the in-memory counter       -> 7
 *   created   <state>/created.txt still holds what was written at start          -> 8
 *   ticklog   the tick log's last line is the previous tick (before appending)   -> 9
 * Stalls (threads, seq) are judged by CLOCK_MONOTONIC with generous slack, and the
 * slack restarts whenever the clock jumps or the process was frozen or restored,
 * so the clock of another node after a restore never counts as a stall.
 *
 * The TCP port answers "counter=<n> child=<pid>\n" at once (unchanged: tests parse that
 * line); a client that sends anything or shuts down its side within 500 ms also gets
 * "ok threads=<worker count> seq=<last seq echoed in order> db=<rows|off> gen=<restores>\n",
 * a snapshot taken with the first line (db == counter; seq is counter or a tick or two
 * behind; gen counts restores, seen as a change of our start time in /proc/self/stat, and
 * is left out when /proc is not readable).
 *
 * With HERMIT_LEDGER=<IPv4>:<port> every tick is also reported, as it happens, in one UDP
 * datagram to that collector (the tests' external ledger, tests/support/ledger.py):
 *   "hermit-ledger v1 tick=<n> prev=<n> first=<n> gen=<n> pid=<n> start=<n> host=<name>
 *    errs=<n>\n"
 * prev is the tick this process image reported before (0 for none: it lives in memory, so
 * a restored copy carries it), first the first tick this copy made (since its start or
 * its restore: so a copy's first reports lost in transit still count), start our start time (it changes with every restore, so it
 * tells copies apart with the sender's address), host the UTS name (the sandbox's), errs
 * how many earlier reports this image failed to send. A failed send is counted, never
 * fatal: the ledger judges, the workload only reports.
 *
 * Configuration is by environment only (see --help and README in node-agent/init).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sqlite3.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/utsname.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#ifndef HERMIT_WORKLOAD_VERSION
#define HERMIT_WORKLOAD_VERSION "dev"
#endif

#define EXIT_SETUP 1
#define EXIT_USAGE 2
#define EXIT_MEMORY_CORRUPT 3
#define EXIT_CHILD_LOST 4
#define EXIT_THREAD_STALLED 5
#define EXIT_SEQ_BROKEN 6
#define EXIT_DB_BROKEN 7
#define EXIT_CREATED_CHANGED 8
#define EXIT_TICK_LOG_BROKEN 9

#define WORKER_PERIOD_MS 20 /* the worker thread's increment period */
#define STALL_TICKS 3       /* a stall also needs this many ticks without progress */
#define STATUS_WAIT_MS 500  /* how long a TCP client may take to ask for the status line */
#define MAX_PENDING 16      /* TCP clients waiting for that */
#define OK_EVERY 50         /* an "ok" line on stderr every this many ticks */

static volatile sig_atomic_t stop_signal;
static char state_dir[1024];

static void on_stop(int sig) { stop_signal = sig; }

static void out(int fd, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void out(int fd, const char *fmt, ...) {
	char buf[512];
	va_list ap;
	va_start(ap, fmt);
	int n = vsnprintf(buf, sizeof(buf), fmt, ap);
	va_end(ap);
	if (n > (int)sizeof(buf) - 1)
		n = (int)sizeof(buf) - 1;
	if (n > 0 && write(fd, buf, (size_t)n) < 0) { /* stdout may be gone; keep going */ }
}

static void die(const char *what) {
	out(2, "hermit-stateful: %s: %s\n", what, strerror(errno));
	exit(EXIT_SETUP);
}

/* A broken invariant: one line on stderr, then the invariant's exit code. */
static void fail(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3), noreturn));
static void fail(int code, const char *fmt, ...) {
	char buf[400];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(buf, sizeof(buf), fmt, ap);
	va_end(ap);
	out(2, "hermit-stateful: %s\n", buf);
	exit(code);
}

static const char *env_str(const char *name, const char *dflt) {
	const char *v = getenv(name);
	return v ? v : dflt;
}

static long env_long(const char *name, long dflt, long min, long max) {
	const char *v = getenv(name);
	if (!v || !*v)
		return dflt;
	char *end;
	errno = 0;
	long n = strtol(v, &end, 10);
	if (errno || *end || n < min || n > max) {
		out(2, "hermit-stateful: %s must be an integer in [%ld, %ld], got '%s'\n", name, min,
		    max, v);
		exit(EXIT_SETUP);
	}
	return n;
}

static long long now_ms(void) {
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static long long unix_ms(void) {
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static void mkdir_p(const char *dir) {
	char p[1024];
	snprintf(p, sizeof(p), "%s", dir);
	for (char *s = p + 1; *s; s++) {
		if (*s == '/') {
			*s = '\0';
			mkdir(p, 0755);
			*s = '/';
		}
	}
	if (mkdir(p, 0755) < 0 && errno != EEXIST)
		die(dir);
}

static int write_all(int fd, const void *data, size_t n) {
	const char *p = data;
	while (n) {
		ssize_t w = write(fd, p, n);
		if (w < 0) {
			if (errno == EINTR)
				continue;
			return -1;
		}
		p += w;
		n -= (size_t)w;
	}
	return 0;
}

/* Rewrites <state_dir>/<name> with text. */
static int write_state(const char *name, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int write_state(const char *name, const char *fmt, ...) {
	char path[1200], buf[256];
	snprintf(path, sizeof(path), "%s/%s", state_dir, name);
	va_list ap;
	va_start(ap, fmt);
	int n = vsnprintf(buf, sizeof(buf), fmt, ap);
	va_end(ap);
	int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
	if (fd < 0)
		return -1;
	ssize_t w = write(fd, buf, (size_t)n);
	close(fd);
	return w == n ? 0 : -1;
}

static uint64_t pattern(size_t i) { return (uint64_t)i * 0x9E3779B97F4A7C15ULL ^ 0x4845524D4954ULL; }

/* ---- the background child ------------------------------------------------------------- */

/* Heartbeats into a file and over the pipe until the parent goes, and echoes every
 * 8-byte sequence number the parent sends over the socketpair, immediately. */
static void child_main(int wfd, int sfd, pid_t parent, long beat_ms) {
	signal(SIGTERM, SIG_DFL);
	signal(SIGINT, SIG_DFL);
	write_state("child.pid", "%d\n", (int)getpid());
	unsigned char buf[256];
	size_t have = 0;
	long long next = now_ms() + beat_ms;
	for (long beats = 1;;) {
		long long now = now_ms();
		if (next - now > beat_ms)
			next = now + beat_ms; /* the clock jumped back (restored on another node) */
		if (now >= next) {
			if (getppid() != parent)
				_exit(0);
			write_state("child.txt", "pid=%d beats=%ld\n", (int)getpid(), beats);
			if (write(wfd, "b", 1) < 0 && errno != EINTR && errno != EAGAIN)
				_exit(0);
			beats++;
			next = now - next > beat_ms ? now + beat_ms : next + beat_ms;
			continue;
		}
		struct pollfd p = {sfd, POLLIN, 0};
		if (poll(&p, 1, (int)(next - now)) <= 0)
			continue; /* timeout, or EINTR (e.g. after a restore) */
		ssize_t r = read(sfd, buf + have, sizeof(buf) - have);
		if (r == 0)
			_exit(0); /* the parent is gone */
		if (r < 0) {
			if (errno == EINTR || errno == EAGAIN)
				continue;
			_exit(0);
		}
		have += (size_t)r;
		size_t whole = have - have % 8;
		if (whole && write_all(sfd, buf, whole) < 0)
			_exit(0);
		memmove(buf, buf + whole, have - whole);
		have -= whole;
	}
}

/* ---- the worker thread ---------------------------------------------------------------- */

static unsigned long long worker_count;

static void *worker_main(void *arg) {
	(void)arg;
	for (;;) {
		struct timespec ts = {0, WORKER_PERIOD_MS * 1000000L};
		nanosleep(&ts, NULL); /* EINTR (a restore returns it) is an early wake-up */
		__atomic_add_fetch(&worker_count, 1, __ATOMIC_RELAXED);
	}
	return NULL;
}

/* ---- stall detection -------------------------------------------------------------------- */

/* A value that must keep changing: stalled when it stayed the same for STALL_TICKS ticks
 * and more than stall_ms of monotonic time since it last changed. */
struct watch {
	unsigned long long seen;
	long long changed_ms;
	int still_ticks;
};

static void watch_restart(struct watch *w, long long now) {
	w->changed_ms = now;
	w->still_ticks = 0;
}

/* Returns how long the value has been stuck (ms) if that is a stall, else -1. */
static long long watch_check(struct watch *w, unsigned long long value, long long now,
			     long long stall_ms) {
	if (value != w->seen || now < w->changed_ms) {
		w->seen = value;
		watch_restart(w, now);
		return -1;
	}
	if (++w->still_ticks >= STALL_TICKS && now - w->changed_ms > stall_ms)
		return now - w->changed_ms;
	return -1;
}

/* ---- restore detection ------------------------------------------------------------------ */

/* Field 22 of /proc/self/stat (start time in clock ticks after boot). CRIU restores a
 * process by creating a new one, so this changes exactly when we were restored. */
static long long read_starttime(void) {
	char buf[1024];
	int fd = open("/proc/self/stat", O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return -1;
	ssize_t n = read(fd, buf, sizeof(buf) - 1);
	close(fd);
	if (n <= 0)
		return -1;
	buf[n] = '\0';
	char *p = strrchr(buf, ')');
	if (!p)
		return -1;
	p++;
	for (int field = 3; field <= 22; field++) { /* p is at the space before `field` */
		while (*p == ' ')
			p++;
		if (!*p)
			return -1;
		if (field == 22)
			return strtoll(p, NULL, 10);
		while (*p && *p != ' ')
			p++;
	}
	return -1;
}

/* ---- the database ----------------------------------------------------------------------- */

static sqlite3 *db;
static sqlite3_stmt *db_insert, *db_check;
static long long db_rows = -1; /* rows at the last check; -1 = no database */

static void db_setup_failed(const char *path, const char *what) {
	out(2, "hermit-stateful: HERMIT_DB_PATH %s: %s: %s\n", path, what,
	    db ? sqlite3_errmsg(db) : "cannot allocate");
	exit(EXIT_SETUP);
}

/* A fresh database at path in WAL mode, open for the whole run. The "unix-none" VFS
 * with locking_mode=EXCLUSIVE keeps no POSIX file locks and no -shm mapping (the WAL
 * index lives in our heap), so a plain `criu dump` (no --file-locks) can carry it;
 * the database and its -wal file are ordinary files that must move with the workspace. */
static void db_open(const char *path) {
	static const char *const suffixes[] = {"", "-wal", "-shm", "-journal"};
	for (size_t i = 0; i < sizeof(suffixes) / sizeof(*suffixes); i++) {
		char p[1200];
		snprintf(p, sizeof(p), "%s%s", path, suffixes[i]);
		if (unlink(p) < 0 && errno != ENOENT)
			die(p);
	}
	if (sqlite3_open_v2(path, &db, SQLITE_OPEN_READWRITE | SQLITE_OPEN_CREATE |
					     SQLITE_OPEN_NOMUTEX, "unix-none") != SQLITE_OK)
		db_setup_failed(path, "open");
	if (sqlite3_exec(db, "PRAGMA locking_mode=EXCLUSIVE", NULL, NULL, NULL) != SQLITE_OK)
		db_setup_failed(path, "locking_mode");
	sqlite3_stmt *st;
	if (sqlite3_prepare_v2(db, "PRAGMA journal_mode=WAL", -1, &st, NULL) != SQLITE_OK ||
	    sqlite3_step(st) != SQLITE_ROW)
		db_setup_failed(path, "journal_mode");
	const char *mode = (const char *)sqlite3_column_text(st, 0);
	if (!mode || strcmp(mode, "wal") != 0) {
		out(2, "hermit-stateful: HERMIT_DB_PATH %s: journal_mode is %s, not wal\n", path,
		    mode ? mode : "?");
		exit(EXIT_SETUP);
	}
	sqlite3_finalize(st);
	if (sqlite3_exec(db,
			 "PRAGMA synchronous=NORMAL; PRAGMA mmap_size=0; PRAGMA temp_store=MEMORY;"
			 "CREATE TABLE ticks(n INTEGER PRIMARY KEY, unix_ms INTEGER NOT NULL)",
			 NULL, NULL, NULL) != SQLITE_OK)
		db_setup_failed(path, "create table");
	if (sqlite3_prepare_v2(db, "INSERT INTO ticks(n, unix_ms) VALUES(?, ?)", -1, &db_insert,
			       NULL) != SQLITE_OK ||
	    sqlite3_prepare_v2(db, "SELECT count(*), min(n), max(n) FROM ticks", -1, &db_check,
			       NULL) != SQLITE_OK)
		db_setup_failed(path, "prepare");
	db_rows = 0;
}

/* One row per tick, then the table must hold exactly the rows 1..counter. */
static void db_tick(long long counter) {
	sqlite3_bind_int64(db_insert, 1, counter);
	sqlite3_bind_int64(db_insert, 2, unix_ms());
	int rc = sqlite3_step(db_insert);
	sqlite3_reset(db_insert);
	if (rc != SQLITE_DONE)
		fail(EXIT_DB_BROKEN, "invariant db broken: insert of row %lld: %s", counter,
		     sqlite3_errmsg(db));
	/* drop the page cache so the check reads the database and WAL files, not memory */
	sqlite3_db_release_memory(db);
	rc = sqlite3_step(db_check);
	long long rows = -1, lo = -1, hi = -1;
	if (rc == SQLITE_ROW) {
		rows = sqlite3_column_int64(db_check, 0);
		lo = sqlite3_column_int64(db_check, 1);
		hi = sqlite3_column_int64(db_check, 2);
	}
	sqlite3_reset(db_check);
	if (rc != SQLITE_ROW)
		fail(EXIT_DB_BROKEN, "invariant db broken: SELECT count(*), min(n), max(n) at tick %lld: %s",
		     counter, sqlite3_errmsg(db));
	if (rows != counter || lo != 1 || hi != counter)
		fail(EXIT_DB_BROKEN,
		     "invariant db broken: count(*)=%lld min(n)=%lld max(n)=%lld, expected rows "
		     "1..%lld",
		     rows, lo, hi, counter);
	db_rows = rows;
}

/* ---- files -------------------------------------------------------------------------------- */

static char created_path[1200], created_text[128];

static void check_created(long long counter) {
	char buf[sizeof(created_text) + 1];
	int fd = open(created_path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		fail(EXIT_CREATED_CHANGED, "invariant created broken: %s: %s (tick %lld)",
		     created_path, strerror(errno), counter);
	ssize_t n = read(fd, buf, sizeof(buf));
	close(fd);
	if (n != (ssize_t)strlen(created_text) || memcmp(buf, created_text, (size_t)n) != 0)
		fail(EXIT_CREATED_CHANGED,
		     "invariant created broken: %s no longer holds what was written at start "
		     "(tick %lld)",
		     created_path, counter);
}

/* Before tick `prev + 1` is appended, the log's last line must be "tick <prev>" and the
 * log must be as long as it was right after we appended that line. */
static off_t tick_log_size = -1; /* after our last append */

static void check_tick_log(int rd, const char *path, long long prev) {
	char want[48], tail[96];
	int wl = snprintf(want, sizeof(want), "tick %lld\n", prev);
	struct stat st;
	if (fstat(rd, &st) < 0)
		fail(EXIT_TICK_LOG_BROKEN, "invariant ticklog broken: fstat %s: %s", path,
		     strerror(errno));
	off_t from = st.st_size > (off_t)sizeof(tail) - 1 ? st.st_size - (off_t)sizeof(tail) + 1 : 0;
	ssize_t n = pread(rd, tail, sizeof(tail) - 1, from);
	if (n < 0)
		n = 0;
	tail[n] = '\0';
	/* the tail must end with want, preceded by a newline or the start of the file */
	int ok = 0;
	if (n >= wl) {
		const char *at = tail + n - wl;
		ok = memcmp(at, want, (size_t)wl) == 0 && (at > tail ? at[-1] == '\n' : from == 0);
	}
	if (!ok) {
		if (n > 0 && tail[n - 1] == '\n')
			tail[--n] = '\0';
		const char *nl = strrchr(tail, '\n');
		fail(EXIT_TICK_LOG_BROKEN,
		     "invariant ticklog broken: the last line of %s is '%s', not 'tick %lld' "
		     "(size %lld)",
		     path, nl ? nl + 1 : tail, prev, (long long)st.st_size);
	}
	if (tick_log_size >= 0 && st.st_size != tick_log_size)
		fail(EXIT_TICK_LOG_BROKEN,
		     "invariant ticklog broken: %s is %lld bytes, %lld after 'tick %lld' was "
		     "appended",
		     path, (long long)st.st_size, (long long)tick_log_size, prev);
}

/* ---- the external ledger ---------------------------------------------------------------- */

/* One unconnected UDP socket for the whole run: CRIU carries it over (an unconnected UDP
 * socket needs no --tcp-established), and a send that fails makes us reopen it. */
static int ledger_fd = -1;
static struct sockaddr_in ledger_addr;
static long long ledger_prev, ledger_errs;

static void ledger_setup(const char *spec) {
	char ip[64];
	const char *colon = strrchr(spec, ':');
	char *end;
	long port = colon ? strtol(colon + 1, &end, 10) : -1;
	if (!colon || (size_t)(colon - spec) >= sizeof(ip) || colon[1] == '\0' || *end ||
	    port < 1 || port > 65535) {
		out(2, "hermit-stateful: HERMIT_LEDGER must be <IPv4>:<port>, got '%s'\n", spec);
		exit(EXIT_SETUP);
	}
	snprintf(ip, sizeof(ip), "%.*s", (int)(colon - spec), spec);
	memset(&ledger_addr, 0, sizeof(ledger_addr));
	ledger_addr.sin_family = AF_INET;
	ledger_addr.sin_port = htons((uint16_t)port);
	if (inet_pton(AF_INET, ip, &ledger_addr.sin_addr) != 1) {
		out(2, "hermit-stateful: HERMIT_LEDGER '%s' is not an IPv4 address\n", spec);
		exit(EXIT_SETUP);
	}
	ledger_fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
	if (ledger_fd < 0)
		die("ledger socket");
}

static void ledger_report(long long tick, long long first, int gen, long long start) {
	struct utsname u;
	if (uname(&u) < 0)
		snprintf(u.nodename, sizeof(u.nodename), "?");
	char buf[256];
	int n = snprintf(buf, sizeof(buf),
			 "hermit-ledger v1 tick=%lld prev=%lld first=%lld gen=%d pid=%d start=%lld "
			 "host=%.64s errs=%lld\n",
			 tick, ledger_prev, first, gen, (int)getpid(), start, u.nodename, ledger_errs);
	if (n > (int)sizeof(buf) - 1)
		n = (int)sizeof(buf) - 1;
	if (ledger_fd < 0)
		ledger_fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
	ssize_t w = ledger_fd < 0 ? -1 : sendto(ledger_fd, buf, (size_t)n, MSG_DONTWAIT,
						(struct sockaddr *)&ledger_addr, sizeof(ledger_addr));
	if (w != n) {
		ledger_errs++;
		if (ledger_fd >= 0 && errno != EAGAIN && errno != EINTR) {
			close(ledger_fd); /* e.g. a socket a restore could not carry: a fresh one */
			ledger_fd = -1;
		}
	}
	ledger_prev = tick;
}

/* ---- TCP ---------------------------------------------------------------------------------- */

struct pending {
	int fd; /* -1 = free */
	long long deadline;
	char status[200]; /* the second line as of the first one, so both agree */
};
static struct pending pending[MAX_PENDING];

static int listen_tcp(const char *addr, long port) {
	int s = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
	if (s < 0)
		die("socket");
	int one = 1;
	setsockopt(s, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
	struct sockaddr_in a;
	memset(&a, 0, sizeof(a));
	a.sin_family = AF_INET;
	a.sin_port = htons((uint16_t)port);
	if (inet_pton(AF_INET, addr, &a.sin_addr) != 1) {
		out(2, "hermit-stateful: HERMIT_LISTEN_ADDR '%s' is not an IPv4 address\n", addr);
		exit(EXIT_SETUP);
	}
	if (bind(s, (struct sockaddr *)&a, sizeof(a)) < 0)
		die("bind");
	if (listen(s, 64) < 0)
		die("listen");
	return s;
}

/* Reads what the client sent (without blocking): >0 it sent a request, 0 it shut down its
 * side (e.g. `nc </dev/null`); both ask for the status line. -1: nothing yet (EAGAIN). */
static ssize_t drain(int fd) {
	char buf[256];
	ssize_t total = 0, r;
	while ((r = recv(fd, buf, sizeof(buf), MSG_DONTWAIT)) > 0 && total < 65536)
		total += r;
	if (total > 0)
		return total;
	return r; /* 0: closed by the client; -1: nothing yet (EAGAIN) or an error */
}

/* The second line of the TCP answer (after "ok "), also used by the "ok" line on stderr. */
static void status_line(char *buf, size_t size, unsigned long long seq_echoed, int gen_known,
			int gen) {
	char dbs[32] = "off", gens[32] = "";
	if (db_rows >= 0)
		snprintf(dbs, sizeof(dbs), "%lld", db_rows);
	if (gen_known) /* /proc/self/stat was readable */
		snprintf(gens, sizeof(gens), " gen=%d", gen);
	snprintf(buf, size, "threads=%llu seq=%llu db=%s%s",
		 __atomic_load_n(&worker_count, __ATOMIC_RELAXED), seq_echoed, dbs, gens);
}

static void usage(void) {
	fputs("usage: hermit-stateful [--help|--version]   (configured by environment)\n"
	       "  HERMIT_TICK_MS=100          tick period\n"
	       "  PORT=7000                   TCP port (0 = any); answers 'counter=<n> child=<pid>\\n'\n"
	       "                              at once; a client that sends anything (e.g. 'status\\n')\n"
	       "                              or shuts down its side (nc </dev/null) within 500 ms\n"
	       "                              also gets 'ok threads=<n> seq=<n> db=<rows|off> gen=<n>\\n'\n"
	       "                              (one that just waits gets the first line only)\n"
	       "  HERMIT_LISTEN_ADDR=0.0.0.0  IPv4 address to listen on\n"
	       "  HERMIT_STATE_DIR=/state     counter.txt, created.txt, child.pid, child.txt\n"
	       "  HERMIT_TICK_LOG=/workspace/ticks.log   'tick <n>' appended per tick\n"
	       "  HERMIT_DB_PATH=<dir of HERMIT_TICK_LOG>/agent.db (/workspace/agent.db)\n"
	       "                              SQLite database (WAL), recreated at start, one row\n"
	       "                              per tick ('' = no database)\n"
	       "  HERMIT_DELETE_PATH=/etc/hermit-delete-me   deleted at start ('' = none)\n"
	       "  HERMIT_WORKLOAD_MEM_MB=0    patterned memory, verified each tick (exit 3 if bad)\n"
	       "  HERMIT_WORKLOAD_VERIFY_MB=64  memory verified per tick (rolling)\n"
	       "  HERMIT_CHILD_MS=500         child heartbeat period\n"
	       "  HERMIT_STALL_MS=5000        worker thread / child echo may stall this long\n"
	       "                              (and 3 ticks); restarts after a clock jump or restore\n"
	       "  HERMIT_MAX_TICKS=0          exit 0 after this many ticks (0 = never)\n"
	       "  HERMIT_LEDGER=<ip>:<port>   also report every tick in a UDP datagram there\n"
	       "                              ('hermit-ledger v1 tick=.. prev=.. first=.. gen=..\n"
	       "                              pid=.. start=.. host=.. errs=..'; unset = none)\n"
	       "Checked every tick; a broken invariant prints one line on stderr and exits:\n"
	       "  0 on SIGTERM/SIGINT or max ticks, 1 setup error, 2 usage error,\n"
	       "  3 memory corrupted, 4 background child lost (pipe or socketpair closed),\n"
	       "  5 worker thread stopped advancing, 6 socketpair sequence echoed with a gap,\n"
	       "  repeat or stall, 7 database rows != counter (or an SQLite error),\n"
	       "  8 <state>/created.txt changed or gone, 9 tick log's last line is not the\n"
	       "  previous tick.\n"
	       "stderr: an 'ok counter=... threads=... seq=... db=... gen=...' line every 50 ticks\n"
	       "and 'restore detected' when /proc/self/stat's start time changes (gen += 1).\n",
	       stdout);
}

int main(int argc, char **argv) {
	if (argc > 1 && strcmp(argv[1], "--version") == 0) {
		out(1, "hermit-stateful %s\n", HERMIT_WORKLOAD_VERSION);
		return 0;
	}
	if (argc > 1) {
		usage();
		return strcmp(argv[1], "--help") == 0 ? 0 : EXIT_USAGE;
	}
	long tick_ms = env_long("HERMIT_TICK_MS", 100, 1, 3600000);
	long port = env_long("PORT", 7000, 0, 65535);
	long mem_mb = env_long("HERMIT_WORKLOAD_MEM_MB", 0, 0, 1 << 20);
	long verify_mb = env_long("HERMIT_WORKLOAD_VERIFY_MB", 64, 1, 1 << 20);
	long child_ms = env_long("HERMIT_CHILD_MS", 500, 1, 3600000);
	long stall_ms = env_long("HERMIT_STALL_MS", 5000, 100, 86400000);
	long max_ticks = env_long("HERMIT_MAX_TICKS", 0, 0, 1L << 40);
	const char *log_path = env_str("HERMIT_TICK_LOG", "/workspace/ticks.log");
	const char *ledger = env_str("HERMIT_LEDGER", "");
	if (*ledger)
		ledger_setup(ledger);
	const char *delete_path = env_str("HERMIT_DELETE_PATH", "/etc/hermit-delete-me");
	snprintf(state_dir, sizeof(state_dir), "%s", env_str("HERMIT_STATE_DIR", "/state"));
	char db_path[1024];
	if (getenv("HERMIT_DB_PATH")) {
		snprintf(db_path, sizeof(db_path), "%s", getenv("HERMIT_DB_PATH"));
	} else { /* next to the tick log: both live on the workspace */
		const char *slash = strrchr(log_path, '/');
		if (slash)
			snprintf(db_path, sizeof(db_path), "%.*s/agent.db", (int)(slash - log_path),
				 log_path);
		else
			snprintf(db_path, sizeof(db_path), "agent.db");
	}

	struct sigaction sa;
	memset(&sa, 0, sizeof(sa));
	sa.sa_handler = on_stop; /* no SA_RESTART: poll() returns EINTR */
	sigaction(SIGTERM, &sa, NULL);
	sigaction(SIGINT, &sa, NULL);
	signal(SIGPIPE, SIG_IGN);

	mkdir_p(state_dir);
	snprintf(created_path, sizeof(created_path), "%s/created.txt", state_dir);
	snprintf(created_text, sizeof(created_text), "created by pid %d\n", (int)getpid());
	if (write_state("created.txt", "%s", created_text) < 0)
		die("write created.txt");
	if (*delete_path && unlink(delete_path) < 0)
		out(2, "hermit-stateful: delete %s: %s\n", delete_path, strerror(errno));
	int log_fd = open(log_path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
	if (log_fd < 0)
		die(log_path);
	/* A separate read-only fd, opened once, to read the log's tail (regular files only). */
	int log_rd = open(log_path, O_RDONLY | O_CLOEXEC);
	if (log_rd < 0)
		die(log_path);
	struct stat lst;
	if (fstat(log_rd, &lst) < 0)
		die(log_path);
	if (!S_ISREG(lst.st_mode)) {
		close(log_rd);
		log_rd = -1;
	}

	uint64_t *mem = NULL;
	size_t words = (size_t)mem_mb * (1 << 20) / sizeof(uint64_t), verify_at = 0;
	if (words) {
		mem = mmap(NULL, words * sizeof(uint64_t), PROT_READ | PROT_WRITE,
			   MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
		if (mem == MAP_FAILED)
			die("mmap");
		for (size_t i = 0; i < words; i++)
			mem[i] = pattern(i);
		out(1, "mem addr=%p mb=%ld\n", (void *)mem, mem_mb);
	}

	int pfd[2], sp[2];
	if (pipe2(pfd, O_CLOEXEC) < 0)
		die("pipe");
	if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sp) < 0)
		die("socketpair");
	pid_t parent = getpid(), child = fork();
	if (child < 0)
		die("fork");
	if (child == 0) {
		close(pfd[0]);
		close(sp[0]);
		close(log_fd);
		if (log_rd >= 0)
			close(log_rd);
		child_main(pfd[1], sp[1], parent, child_ms);
	}
	close(pfd[1]);
	close(sp[1]);

	/* After the fork: the child has no database connection and no thread. */
	if (*db_path)
		db_open(db_path);
	sigset_t all, old;
	sigfillset(&all);
	pthread_sigmask(SIG_BLOCK, &all, &old); /* signals go to the main thread only */
	pthread_t worker;
	int err = pthread_create(&worker, NULL, worker_main, NULL);
	pthread_sigmask(SIG_SETMASK, &old, NULL);
	if (err) {
		errno = err;
		die("pthread_create");
	}

	int lfd = listen_tcp(env_str("HERMIT_LISTEN_ADDR", "0.0.0.0"), port);
	if (port == 0) {
		struct sockaddr_in a;
		socklen_t al = sizeof(a);
		if (getsockname(lfd, (struct sockaddr *)&a, &al) == 0)
			port = ntohs(a.sin_port);
	}
	out(1, "hermit-stateful start pid=%d child=%d port=%ld\n", (int)parent, (int)child, port);
	for (int i = 0; i < MAX_PENDING; i++)
		pending[i].fd = -1;

	long long counter = 0, child_beats = 0;
	unsigned long long seq_sent = 0, seq_echoed = 0;
	unsigned char seq_buf[64];
	size_t seq_have = 0;
	long long start = now_ms(), next = start + tick_ms;
	struct watch thread_watch = {0, start, 0}, seq_watch = {0, start, 0};
	long long started_at = read_starttime();
	long long copy_first = 0; /* the first tick of this copy (since start or restore) */
	int gen = 0;
	char status[200];

	while (!stop_signal) {
		long long now = now_ms();
		if (next - now > tick_ms || now - next > tick_ms) {
			/* the clock jumped (restored on another node) or we were frozen: resync */
			next = now + tick_ms;
			watch_restart(&thread_watch, now);
			watch_restart(&seq_watch, now);
		}
		for (int i = 0; i < MAX_PENDING; i++) {
			if (pending[i].fd >= 0 &&
			    (now >= pending[i].deadline || pending[i].deadline - now > STATUS_WAIT_MS)) {
				close(pending[i].fd); /* no request: the one-line answer it got is all */
				pending[i].fd = -1;
			}
		}
		if (now >= next) {
			counter++;
			next += tick_ms;
			long long st = read_starttime();
			if (st >= 0 && started_at >= 0 && st != started_at) {
				gen++;
				copy_first = 0;
				watch_restart(&thread_watch, now);
				watch_restart(&seq_watch, now);
				out(2, "hermit-stateful: restore detected (gen=%d) at counter %lld\n", gen,
				    counter);
			}
			if (st >= 0)
				started_at = st;
			/* reported first (gen and start are this copy's): a tick cut by a freeze is in
			 * the ledger before it is in any log, so no log shows a tick the ledger lacks */
			if (!copy_first)
				copy_first = counter;
			if (*ledger)
				ledger_report(counter, copy_first, gen, st);
			if (log_rd >= 0 && counter > 1)
				check_tick_log(log_rd, log_path, counter - 1);
			write_state("counter.txt", "%lld\n", counter);
			out(log_fd, "tick %lld\n", counter);
			if (log_rd >= 0)
				tick_log_size = fstat(log_rd, &lst) == 0 ? lst.st_size : -1;
			out(1, "tick %lld\n", counter);
			size_t span = (size_t)verify_mb * (1 << 20) / sizeof(uint64_t);
			for (size_t k = 0; k < span && words; k++, verify_at = (verify_at + 1) % words) {
				if (mem[verify_at] != pattern(verify_at)) {
					out(2, "hermit-stateful: memory corrupted at word %zu (tick %lld)\n",
					    verify_at, counter);
					return EXIT_MEMORY_CORRUPT;
				}
			}
			check_created(counter);

			unsigned long long threads = __atomic_load_n(&worker_count, __ATOMIC_RELAXED);
			long long stuck = watch_check(&thread_watch, threads, now, stall_ms);
			if (stuck >= 0)
				fail(EXIT_THREAD_STALLED,
				     "invariant threads broken: the worker thread's counter stayed at %llu "
				     "for %lld ms (tick %lld)",
				     threads, stuck, counter);
			if (seq_echoed < seq_sent) {
				stuck = watch_check(&seq_watch, seq_echoed, now, stall_ms);
				if (stuck >= 0)
					fail(EXIT_SEQ_BROKEN,
					     "invariant seq broken: the child echoed nothing after %llu "
					     "for %lld ms (sent %llu, tick %lld)",
					     seq_echoed, stuck, seq_sent, counter);
			} else {
				seq_watch.seen = seq_echoed;
				watch_restart(&seq_watch, now);
			}
			uint64_t seq = ++seq_sent;
			if (write_all(sp[0], &seq, sizeof(seq)) < 0) {
				out(2, "hermit-stateful: background child %d is gone: socketpair: %s "
				       "(tick %lld)\n",
				    (int)child, strerror(errno), counter);
				return EXIT_CHILD_LOST;
			}
			if (db)
				db_tick(counter);
			if (counter % OK_EVERY == 0) {
				status_line(status, sizeof(status), seq_echoed, started_at >= 0, gen);
				out(2, "hermit-stateful: ok counter=%lld %s\n", counter, status);
			}
			if (max_ticks && counter >= max_ticks)
				break;
			continue;
		}

		struct pollfd fds[3 + MAX_PENDING];
		int slot[3 + MAX_PENDING], nfds = 3;
		fds[0] = (struct pollfd){lfd, POLLIN, 0};
		fds[1] = (struct pollfd){pfd[0], POLLIN, 0};
		fds[2] = (struct pollfd){sp[0], POLLIN, 0};
		long long wait = next - now;
		for (int i = 0; i < MAX_PENDING; i++) {
			if (pending[i].fd < 0)
				continue;
			if (pending[i].deadline - now < wait)
				wait = pending[i].deadline - now;
			slot[nfds] = i;
			fds[nfds++] = (struct pollfd){pending[i].fd, POLLIN, 0};
		}
		int n = poll(fds, (nfds_t)nfds, (int)(wait < 0 ? 0 : wait));
		if (n < 0 && errno != EINTR)
			die("poll");
		if (n <= 0)
			continue;
		if (fds[0].revents & POLLIN) {
			int c = accept4(lfd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
			if (c >= 0) {
				ssize_t req = drain(c);
				int drain_errno = errno;
				status_line(status, sizeof(status), seq_echoed, started_at >= 0, gen);
				if (req >= 0) { /* asked (or shut its side) already: both lines at once */
					out(c, "counter=%lld child=%d\nok %s\n", counter, (int)child, status);
					close(c);
				} else {
					out(c, "counter=%lld child=%d\n", counter, (int)child);
					if (drain_errno != EAGAIN) {
						close(c);
					} else {
						int free_i = 0;
						for (int i = 0; i < MAX_PENDING; i++) {
							if (pending[i].fd < 0) {
								free_i = i;
								break;
							}
							if (pending[i].deadline < pending[free_i].deadline)
								free_i = i;
						}
						if (pending[free_i].fd >= 0)
							close(pending[free_i].fd); /* the oldest gives way */
						pending[free_i].fd = c;
						pending[free_i].deadline = now + STATUS_WAIT_MS;
						memcpy(pending[free_i].status, status, sizeof(status));
					}
				}
			}
		}
		if (fds[1].revents & (POLLIN | POLLHUP)) {
			char buf[64];
			ssize_t r = read(pfd[0], buf, sizeof(buf));
			if (r == 0) {
				out(2, "hermit-stateful: background child %d is gone (tick %lld)\n",
				    (int)child, counter);
				return EXIT_CHILD_LOST;
			}
			if (r > 0)
				child_beats += r;
		}
		if (fds[2].revents & (POLLIN | POLLHUP | POLLERR)) {
			ssize_t r = read(sp[0], seq_buf + seq_have, sizeof(seq_buf) - seq_have);
			if (r == 0 || (r < 0 && errno != EINTR && errno != EAGAIN)) {
				out(2, "hermit-stateful: background child %d is gone: socketpair %s "
				       "(tick %lld)\n",
				    (int)child, r == 0 ? "closed" : strerror(errno), counter);
				return EXIT_CHILD_LOST;
			}
			if (r > 0)
				seq_have += (size_t)r;
			size_t at = 0;
			for (; seq_have - at >= sizeof(uint64_t); at += sizeof(uint64_t)) {
				uint64_t v;
				memcpy(&v, seq_buf + at, sizeof(v));
				if (v != seq_echoed + 1 || v > seq_sent)
					fail(EXIT_SEQ_BROKEN,
					     "invariant seq broken: the child echoed %llu after %llu (%s; "
					     "sent %llu, tick %lld)",
					     (unsigned long long)v, seq_echoed,
					     v > seq_sent         ? "never sent"
					     : v <= seq_echoed    ? "a repeat"
								  : "a gap",
					     seq_sent, counter);
				seq_echoed = v;
			}
			memmove(seq_buf, seq_buf + at, seq_have - at);
			seq_have -= at;
		}
		for (int k = 3; k < nfds; k++) {
			if (!fds[k].revents)
				continue;
			int i = slot[k], c = pending[i].fd;
			ssize_t req = drain(c);
			int drain_errno = errno;
			if (req >= 0) /* a request, or EOF: the client is done sending */
				out(c, "ok %s\n", pending[i].status);
			if (req >= 0 || drain_errno != EAGAIN) {
				close(c);
				pending[i].fd = -1;
			}
		}
	}
	kill(child, SIGTERM);
	waitpid(child, NULL, 0);
	if (db) {
		sqlite3_finalize(db_insert);
		sqlite3_finalize(db_check);
		sqlite3_close(db);
	}
	out(1, "hermit-stateful stop counter=%lld child_beats=%lld\n", counter, child_beats);
	return 0;
}
