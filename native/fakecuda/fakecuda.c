/*
 * FAKE NVIDIA driver for tests: libcuda's checkpoint calls and the NVML calls cairn's
 * inventory makes, with the real names, signatures and struct layouts, and no GPU.
 *
 * Layouts follow CUDA 13.0's cuda.h (driver r580), where every CUcheckpoint*Args struct is
 * 64 bytes and CUcheckpointRestoreArgs is { gpuPairs; gpuPairsCount; reserved[52 - ptr];
 * reserved1 } (CUDA 13.1+ reuse reserved bytes for custom storage; offsets of the fields
 * used here do not move). Enum values: CUprocessState RUNNING=0 LOCKED=1 CHECKPOINTED=2
 * FAILED=3; CUresult as in cuda.h.
 *
 * It enforces the driver's documented rules: nothing but cuGetErrorString before cuInit;
 * reserved bytes must be zero; per process RUNNING -> LOCKED -> CHECKPOINTED -> LOCKED ->
 * RUNNING, anything else CUDA_ERROR_ILLEGAL_STATE; a restore's gpuPairs list every GPU the
 * process was checkpointed on, each target present, of the same chip, with the memory.
 * A driver older than 580 has no remap: its restore args are all reserved.
 *
 * The driver is called by the supervisor about *another* process, so per-process state
 * lives in files under $FAKECUDA_STATE_DIR (one per pid, under an flock), where a workload
 * puts itself with fakecudaRegister(). The real driver's state lives in the process, so a
 * process CRIU restores comes back CHECKPOINTED; the fake tells a restored process by its
 * start time, which a restore cannot keep. Settings, read at each call:
 *   FAKECUDA_STATE_DIR  the shared state directory (required for the checkpoint calls)
 *   FAKECUDA_GPUS       this node's GPUs: "UUID,NAME,TOTAL_BYTES[,USED_BYTES[,CC[,MIG]]];..."
 *   FAKECUDA_DRIVER     driver version text (default 580.65.06); <580 cannot remap
 *   FAKECUDA_CUDA_VERSION  what cuDriverGetVersion reports (default 13000, 12080 below 580)
 *   FAKECUDA_FAIL       "call=code,..." make a call return that CUresult (a failed
 *                       checkpoint leaves the process FAILED, as the driver may, except
 *                       for CUDA_ERROR_NOT_SUPPORTED); nvmlInit too
 *   FAKECUDA_HANG       "call,..." make a call hang: a lock until its timeout (then
 *                       CUDA_ERROR_TIMEOUT), others FAKECUDA_HANG_MS (default 600000)
 *   FAKECUDA_CONTROL    a file whose lines "fail=call=code,..." and "hang=call,..." add to
 *                       the two above, read at each call (to change them mid-run)
 *   FAKECUDA_RECORD     a file to which each call appends one JSON line of its arguments
 *   FAKECUDA_MPS_CLIENT "1" when fakecudaRegister runs: the process is an MPS client, which
 *                       NVML lists under nvmlDeviceGetMPSComputeRunningProcesses_v3 instead
 *                       of nvmlDeviceGetComputeRunningProcesses_v3 (as the real NVML does)
 */
#define _GNU_SOURCE
#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_OUT_OF_MEMORY 2
#define CUDA_ERROR_NOT_INITIALIZED 3
#define CUDA_ERROR_NO_DEVICE 100
#define CUDA_ERROR_INVALID_DEVICE 101
#define CUDA_ERROR_ILLEGAL_STATE 401
#define CUDA_ERROR_NOT_FOUND 500
#define CUDA_ERROR_NOT_READY 600
#define CUDA_ERROR_NOT_SUPPORTED 801
#define CUDA_ERROR_TIMEOUT 909
#define CUDA_ERROR_UNKNOWN 999

typedef enum {
    CU_PROCESS_STATE_RUNNING = 0,
    CU_PROCESS_STATE_LOCKED = 1,
    CU_PROCESS_STATE_CHECKPOINTED = 2,
    CU_PROCESS_STATE_FAILED = 3,
} CUprocessState;

typedef struct { char bytes[16]; } CUuuid;
typedef uint64_t cuuint64_t;

typedef struct { unsigned int timeoutMs; unsigned int reserved0; cuuint64_t reserved1[7]; }
    CUcheckpointLockArgs;
typedef struct { cuuint64_t reserved[8]; } CUcheckpointCheckpointArgs;
typedef struct { CUuuid oldUuid; CUuuid newUuid; } CUcheckpointGpuPair;
typedef struct {
    CUcheckpointGpuPair *gpuPairs;
    unsigned int gpuPairsCount;
    char reserved[52 - sizeof(CUcheckpointGpuPair *)];
    cuuint64_t reserved1;
} CUcheckpointRestoreArgs;
typedef struct { cuuint64_t reserved[8]; } CUcheckpointUnlockArgs;

_Static_assert(sizeof(CUcheckpointLockArgs) == 64, "CUDA 13.0 layout");
_Static_assert(sizeof(CUcheckpointCheckpointArgs) == 64, "CUDA 13.0 layout");
_Static_assert(sizeof(CUcheckpointRestoreArgs) == 64, "CUDA 13.0 layout");
_Static_assert(sizeof(CUcheckpointUnlockArgs) == 64, "CUDA 13.0 layout");
_Static_assert(sizeof(CUcheckpointGpuPair) == 32, "CUDA 13.0 layout");
_Static_assert(offsetof(CUcheckpointRestoreArgs, gpuPairsCount) == 8, "CUDA 13.0 layout");

#define MAX_GPUS 16
#define MAX_TEXT 128

struct gpu {
    char uuid[MAX_TEXT];
    char name[MAX_TEXT];
    unsigned long long total, used;
    int cc_major, cc_minor, mig;
};

struct proc {
    int state;
    unsigned long long start;  /* the process's start time (/proc/PID/stat field 22) */
    int ngpus;
    char uuid[MAX_GPUS][MAX_TEXT];
    unsigned long long bytes[MAX_GPUS];
    char chip[MAX_GPUS][MAX_TEXT];  /* the name of the GPU it was registered on */
};

static int initialized;

/* -- settings ------------------------------------------------------------------------- */

static const char *env(const char *name, const char *fallback) {
    const char *v = getenv(name);
    return v && *v ? v : fallback;
}

static int driver_major(void) { return atoi(env("FAKECUDA_DRIVER", "580.65.06")); }

static int load_gpus(struct gpu *out) {
    const char *spec = env("FAKECUDA_GPUS", "");
    char buf[4096];
    snprintf(buf, sizeof buf, "%s", spec);
    int n = 0;
    char *save = NULL;
    for (char *item = strtok_r(buf, ";", &save); item && n < MAX_GPUS;
         item = strtok_r(NULL, ";", &save)) {
        struct gpu *g = &out[n];
        memset(g, 0, sizeof *g);
        g->cc_major = 9;
        char *f[6] = {0};
        int k = 0;
        char *s2 = NULL;
        for (char *p = strtok_r(item, ",", &s2); p && k < 6; p = strtok_r(NULL, ",", &s2))
            f[k++] = p;
        if (k < 3) continue;
        snprintf(g->uuid, MAX_TEXT, "%s", f[0]);
        snprintf(g->name, MAX_TEXT, "%s", f[1]);
        g->total = strtoull(f[2], NULL, 10);
        if (k > 3) g->used = strtoull(f[3], NULL, 10);
        if (k > 4) sscanf(f[4], "%d.%d", &g->cc_major, &g->cc_minor);
        if (k > 5) g->mig = atoi(f[5]);
        n++;
    }
    return n;
}

static int find_gpu(struct gpu *gpus, int n, const char *uuid) {
    for (int i = 0; i < n; i++)
        if (strcasecmp(gpus[i].uuid, uuid) == 0) return i;
    return -1;
}

/* FAKECUDA_FAIL or FAKECUDA_HANG, followed by the line "fail=..." or "hang=..." of the file
 * FAKECUDA_CONTROL (read at each call, so a test can change it while a run goes on). */
static void setting(const char *name, const char *control_key, char *out, size_t size) {
    snprintf(out, size, "%s", env(name, ""));
    const char *path = getenv("FAKECUDA_CONTROL");
    FILE *f = path && *path ? fopen(path, "re") : NULL;
    if (!f) return;
    char line[1024];
    size_t klen = strlen(control_key);
    while (fgets(line, sizeof line, f)) {
        line[strcspn(line, "\n")] = '\0';
        if (strncmp(line, control_key, klen) == 0 && line[klen] == '=') {
            size_t used = strlen(out);
            snprintf(out + used, size - used, "%s%s", used ? "," : "", line + klen + 1);
        }
    }
    fclose(f);
}

/* The code to return for `call` (FAKECUDA_FAIL "call=code,..."), or 0. */
static int injected_failure(const char *call) {
    char spec[2048];
    setting("FAKECUDA_FAIL", "fail", spec, sizeof spec);
    size_t len = strlen(call);
    for (const char *p = spec; (p = strstr(p, call)) != NULL; p += len) {
        if ((p == spec || p[-1] == ',') && p[len] == '=') return atoi(p + len + 1);
    }
    return 0;
}

/* Whether `call` is to hang (FAKECUDA_HANG "call,..."). */
static int hangs(const char *call) {
    char spec[2048];
    setting("FAKECUDA_HANG", "hang", spec, sizeof spec);
    size_t len = strlen(call);
    for (const char *p = spec; (p = strstr(p, call)) != NULL; p += len) {
        if ((p == spec || p[-1] == ',') && (p[len] == ',' || p[len] == '\0')) return 1;
    }
    return 0;
}

static void sleep_ms(unsigned long long ms) {
    struct timespec ts = {(time_t)(ms / 1000), (long)(ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) == -1 && errno == EINTR) {}
}

static void hang(void) { sleep_ms(strtoull(env("FAKECUDA_HANG_MS", "600000"), NULL, 10)); }

/* -- the record of calls -------------------------------------------------------------- */

static void record(const char *call, int pid, CUresult rc, const char *extra) {
    const char *path = getenv("FAKECUDA_RECORD");
    if (!path || !*path) return;
    char line[8192];
    int n = snprintf(line, sizeof line, "{\"call\": \"%s\", \"caller\": %d, \"pid\": %d, "
                     "\"rc\": %d%s%s}\n", call, (int)getpid(), pid, rc,
                     extra && *extra ? ", " : "", extra ? extra : "");
    int fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd < 0) return;
    if (write(fd, line, (size_t)n) < 0) {}  /* a test reads it; nothing to do on failure */
    close(fd);
}

/* -- per-process state, shared between processes through files ------------------------- */

static int state_path(int pid, char *out, size_t size) {
    const char *dir = getenv("FAKECUDA_STATE_DIR");
    if (!dir || !*dir) return -1;
    snprintf(out, size, "%s/%d", dir, pid);
    return 0;
}

static int lock_dir(void) {
    const char *dir = getenv("FAKECUDA_STATE_DIR");
    if (!dir || !*dir) return -1;
    char path[4096];
    snprintf(path, sizeof path, "%s/.lock", dir);
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd >= 0) flock(fd, LOCK_EX);
    return fd;
}

static void unlock_dir(int fd) {
    if (fd >= 0) { flock(fd, LOCK_UN); close(fd); }
}

/* The start time of `pid` in clock ticks since boot; 0 when it does not exist. */
static unsigned long long start_time(int pid) {
    char path[64], buf[4096];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    FILE *f = fopen(path, "re");
    if (!f) return 0;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = '\0';
    char *p = strrchr(buf, ')');  /* the command may hold spaces and parentheses */
    if (!p) return 0;
    unsigned long long value = 0;
    int field = 2;
    for (char *tok = strtok(p + 1, " "); tok; tok = strtok(NULL, " ")) {
        if (++field == 22) { value = strtoull(tok, NULL, 10); break; }
    }
    return value;
}

static int save_proc(int pid, const struct proc *p);

/* Reads `pid`'s state file: "STATE START\nUUID BYTES CHIP NAME\n...". 0 on success. A
 * process that is gone has no state; one restored by CRIU is CHECKPOINTED. */
static int load_proc(int pid, struct proc *p) {
    char path[4096];
    if (state_path(pid, path, sizeof path)) return -1;
    FILE *f = fopen(path, "re");
    if (!f) return -1;
    memset(p, 0, sizeof *p);
    if (fscanf(f, "%d %llu", &p->state, &p->start) != 2) { fclose(f); return -1; }
    while (p->ngpus < MAX_GPUS &&
           fscanf(f, " %127s %llu %127[^\n]", p->uuid[p->ngpus], &p->bytes[p->ngpus],
                  p->chip[p->ngpus]) == 3)
        p->ngpus++;
    fclose(f);
    unsigned long long now = start_time(pid);
    if (now == 0) return -1;  /* the process is gone */
    if (now != p->start) {
        /* Another process with the same PID: CRIU restored it, from an image dumped while
         * it was CHECKPOINTED (CRIU cannot dump live GPU state), so that is its state now,
         * whatever happened to the process it was dumped from. */
        p->state = CU_PROCESS_STATE_CHECKPOINTED;
        p->start = now;
        save_proc(pid, p);
    }
    return 0;
}

static int save_proc(int pid, const struct proc *p) {
    char path[4096], tmp[4200];
    if (state_path(pid, path, sizeof path)) return -1;
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "we");
    if (!f) return -1;
    fprintf(f, "%d %llu\n", p->state, p->start);
    for (int i = 0; i < p->ngpus; i++) fprintf(f, "%s %llu %s\n", p->uuid[i], p->bytes[i], p->chip[i]);
    fclose(f);
    return rename(tmp, path);
}

/* Device memory held by registered processes on `uuid` (a checkpointed one holds none). */
static unsigned long long held_on(const char *uuid, int except_pid) {
    const char *dir = getenv("FAKECUDA_STATE_DIR");
    if (!dir || !*dir) return 0;
    unsigned long long total = 0;
    DIR *d = opendir(dir);
    if (!d) return 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (!isdigit((unsigned char)e->d_name[0]) || strchr(e->d_name, '.')) continue;
        int pid = atoi(e->d_name);
        struct proc p;
        if (pid == except_pid || load_proc(pid, &p)) continue;
        if (p.state == CU_PROCESS_STATE_CHECKPOINTED) continue;
        for (int i = 0; i < p.ngpus; i++)
            if (strcasecmp(p.uuid[i], uuid) == 0) total += p.bytes[i];
    }
    closedir(d);
    return total;
}

/* -- UUIDs: CUuuid's 16 bytes -> text "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx" ----------- */

static void uuid_text(const unsigned char b[16], char *out) {
    sprintf(out, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
            b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12],
            b[13], b[14], b[15]);
}

static int all_zero(const void *p, size_t n) {
    const unsigned char *c = p;
    for (size_t i = 0; i < n; i++) if (c[i]) return 0;
    return 1;
}

/* -- the driver API ------------------------------------------------------------------- */

CUresult cuInit(unsigned int flags) {
    CUresult rc = injected_failure("cuInit");
    if (!rc && flags != 0) rc = CUDA_ERROR_INVALID_VALUE;
    if (!rc) initialized = 1;
    record("cuInit", 0, rc, NULL);
    return rc;
}

CUresult cuDriverGetVersion(int *version) {
    if (!version) return CUDA_ERROR_INVALID_VALUE;
    const char *v = getenv("FAKECUDA_CUDA_VERSION");
    *version = v && *v ? atoi(v) : driver_major() >= 580 ? 13000 : 12080;
    return CUDA_SUCCESS;
}

CUresult cuGetErrorString(CUresult error, const char **out) {
    if (!out) return CUDA_ERROR_INVALID_VALUE;
    switch (error) {
    case CUDA_SUCCESS: *out = "no error"; break;
    case CUDA_ERROR_INVALID_VALUE: *out = "invalid argument"; break;
    case CUDA_ERROR_OUT_OF_MEMORY: *out = "out of memory"; break;
    case CUDA_ERROR_NOT_INITIALIZED: *out = "initialization error"; break;
    case CUDA_ERROR_NO_DEVICE: *out = "no CUDA-capable device is detected"; break;
    case CUDA_ERROR_INVALID_DEVICE: *out = "invalid device ordinal"; break;
    case CUDA_ERROR_ILLEGAL_STATE: *out = "the operation cannot be performed in the present state"; break;
    case CUDA_ERROR_NOT_FOUND: *out = "named symbol not found"; break;
    case CUDA_ERROR_NOT_READY: *out = "device not ready"; break;
    case CUDA_ERROR_NOT_SUPPORTED: *out = "operation not supported"; break;
    case CUDA_ERROR_TIMEOUT: *out = "the wait operation timed out"; break;
    case CUDA_ERROR_UNKNOWN: *out = "unknown error"; break;
    default: *out = NULL; return CUDA_ERROR_INVALID_VALUE;
    }
    return CUDA_SUCCESS;
}

/* The common part of the three plain transitions: checks, injected failures and hangs. */
static CUresult transition(const char *call, int pid, int from, int to, const void *args,
                           size_t args_size, const char *extra) {
    CUresult rc = CUDA_SUCCESS;
    struct proc p;
    if (!initialized) rc = CUDA_ERROR_NOT_INITIALIZED;
    else if (args && !all_zero(args, args_size)) rc = CUDA_ERROR_INVALID_VALUE;
    if (!rc && hangs(call)) hang();
    if (rc) { record(call, pid, rc, extra); return rc; }
    int fd = lock_dir();
    if (load_proc(pid, &p)) rc = CUDA_ERROR_NOT_FOUND;
    else if (p.state != from) rc = CUDA_ERROR_ILLEGAL_STATE;
    else if ((rc = injected_failure(call)) != 0) {
        if (to == CU_PROCESS_STATE_CHECKPOINTED && rc != CUDA_ERROR_NOT_SUPPORTED) {
            /* A checkpoint that fails midway may leave it unusable; NOT_SUPPORTED (UVM, IPC)
             * is a refusal before anything moved. */
            p.state = CU_PROCESS_STATE_FAILED;
            save_proc(pid, &p);
        }
    } else {
        p.state = to;
        if (save_proc(pid, &p)) rc = CUDA_ERROR_UNKNOWN;
    }
    unlock_dir(fd);
    record(call, pid, rc, extra);
    return rc;
}

CUresult cuCheckpointProcessGetState(int pid, CUprocessState *state) {
    CUresult rc = CUDA_SUCCESS;
    struct proc p;
    if (!initialized) rc = CUDA_ERROR_NOT_INITIALIZED;
    else if (!state) rc = CUDA_ERROR_INVALID_VALUE;
    if (!rc) rc = injected_failure("cuCheckpointProcessGetState");
    if (!rc && hangs("cuCheckpointProcessGetState")) hang();
    if (!rc) {
        int fd = lock_dir();
        if (load_proc(pid, &p)) rc = CUDA_ERROR_NOT_FOUND;
        else *state = (CUprocessState)p.state;
        unlock_dir(fd);
    }
    record("cuCheckpointProcessGetState", pid, rc, NULL);
    return rc;
}

CUresult cuCheckpointProcessGetRestoreThreadId(int pid, int *tid) {
    CUresult rc = CUDA_SUCCESS;
    struct proc p;
    if (!initialized) rc = CUDA_ERROR_NOT_INITIALIZED;
    else if (!tid) rc = CUDA_ERROR_INVALID_VALUE;
    if (!rc) rc = injected_failure("cuCheckpointProcessGetRestoreThreadId");
    if (!rc && load_proc(pid, &p)) rc = CUDA_ERROR_NOT_FOUND;
    if (!rc) *tid = pid;  /* the fake has no thread of its own in the process */
    record("cuCheckpointProcessGetRestoreThreadId", pid, rc, NULL);
    return rc;
}

CUresult cuCheckpointProcessLock(int pid, CUcheckpointLockArgs *args) {
    unsigned int timeout = args ? args->timeoutMs : 0;
    char extra[64];
    snprintf(extra, sizeof extra, "\"timeout_ms\": %u", timeout);
    if (initialized && hangs("cuCheckpointProcessLock")) {
        /* A lock that cannot get the process quiet waits out its timeout. */
        sleep_ms(timeout ? timeout : strtoull(env("FAKECUDA_HANG_MS", "600000"), NULL, 10));
        record("cuCheckpointProcessLock", pid, CUDA_ERROR_TIMEOUT, extra);
        return CUDA_ERROR_TIMEOUT;
    }
    CUcheckpointLockArgs rest;
    if (args) { rest = *args; rest.timeoutMs = 0; }
    return transition("cuCheckpointProcessLock", pid, CU_PROCESS_STATE_RUNNING,
                      CU_PROCESS_STATE_LOCKED, args ? &rest : NULL, sizeof rest, extra);
}

CUresult cuCheckpointProcessCheckpoint(int pid, CUcheckpointCheckpointArgs *args) {
    return transition("cuCheckpointProcessCheckpoint", pid, CU_PROCESS_STATE_LOCKED,
                      CU_PROCESS_STATE_CHECKPOINTED, args, sizeof *args, NULL);
}

CUresult cuCheckpointProcessUnlock(int pid, CUcheckpointUnlockArgs *args) {
    return transition("cuCheckpointProcessUnlock", pid, CU_PROCESS_STATE_LOCKED,
                      CU_PROCESS_STATE_RUNNING, args, sizeof *args, NULL);
}

CUresult cuCheckpointProcessRestore(int pid, CUcheckpointRestoreArgs *args) {
    static const char *call = "cuCheckpointProcessRestore";
    char extra[4096] = "\"pairs\": [";
    unsigned int count = args ? args->gpuPairsCount : 0;
    if (args && args->gpuPairs && count <= MAX_GPUS) {
        for (unsigned int i = 0; i < count; i++) {
            char o[64], n[64], item[160];
            uuid_text((unsigned char *)args->gpuPairs[i].oldUuid.bytes, o);
            uuid_text((unsigned char *)args->gpuPairs[i].newUuid.bytes, n);
            snprintf(item, sizeof item, "%s[\"%s\", \"%s\"]", i ? ", " : "", o, n);
            strncat(extra, item, sizeof extra - strlen(extra) - 2);
        }
    }
    strcat(extra, "]");

    CUresult rc = CUDA_SUCCESS;
    if (!initialized) rc = CUDA_ERROR_NOT_INITIALIZED;
    else if (args && (!all_zero(args->reserved, sizeof args->reserved) || args->reserved1))
        rc = CUDA_ERROR_INVALID_VALUE;
    else if (args && driver_major() < 580 && (args->gpuPairs || count))
        rc = CUDA_ERROR_INVALID_VALUE;  /* before 580 these bytes are reserved */
    else if (args && (count > MAX_GPUS || (count && !args->gpuPairs)))
        rc = CUDA_ERROR_INVALID_VALUE;
    if (!rc && hangs(call)) hang();
    if (!rc) rc = injected_failure(call);
    if (rc) { record(call, pid, rc, extra); return rc; }

    int fd = lock_dir();
    struct proc p;
    struct gpu gpus[MAX_GPUS];
    int ngpus = load_gpus(gpus);
    if (load_proc(pid, &p)) rc = CUDA_ERROR_NOT_FOUND;
    else if (p.state != CU_PROCESS_STATE_CHECKPOINTED) rc = CUDA_ERROR_ILLEGAL_STATE;
    char target[MAX_GPUS][MAX_TEXT];
    for (int i = 0; !rc && i < p.ngpus; i++) {
        snprintf(target[i], MAX_TEXT, "%s", p.uuid[i]);
        if (count) {
            int listed = 0;
            for (unsigned int k = 0; k < count; k++) {
                char o[64];
                uuid_text((unsigned char *)args->gpuPairs[k].oldUuid.bytes, o);
                if (strcasecmp(o, p.uuid[i]) == 0) {
                    uuid_text((unsigned char *)args->gpuPairs[k].newUuid.bytes, target[i]);
                    listed = 1;
                }
            }
            if (!listed) rc = CUDA_ERROR_INVALID_VALUE;  /* every checkpointed GPU listed */
        }
    }
    for (int i = 0; !rc && i < p.ngpus; i++) {
        int g = find_gpu(gpus, ngpus, target[i]);
        if (g < 0) { rc = CUDA_ERROR_INVALID_DEVICE; break; }
        if (strcmp(p.chip[i], gpus[g].name) != 0) { rc = CUDA_ERROR_INVALID_DEVICE; break; }
        unsigned long long used = gpus[g].used + held_on(target[i], pid);
        if (gpus[g].total < used || gpus[g].total - used < p.bytes[i]) {
            rc = CUDA_ERROR_OUT_OF_MEMORY;
            break;
        }
    }
    if (!rc) {
        for (int i = 0; i < p.ngpus; i++) snprintf(p.uuid[i], MAX_TEXT, "%s", target[i]);
        p.state = CU_PROCESS_STATE_LOCKED;
        if (save_proc(pid, &p)) rc = CUDA_ERROR_UNKNOWN;
    }
    unlock_dir(fd);
    record(call, pid, rc, extra);
    return rc;
}

/* -- the fake's own entry point: a workload puts itself in the state directory -------------- */

/* Registers the calling process as RUNNING with device memory on GPUs: "UUID=BYTES,...".
 * Returns 0, or -1 (no FAKECUDA_STATE_DIR, bad spec). FAKE only: the real driver learns of a
 * process when it creates a context. */
int fakecudaRegister(const char *spec) {
    struct proc p;
    memset(&p, 0, sizeof p);
    struct gpu gpus[MAX_GPUS];
    int ngpus = load_gpus(gpus);
    char buf[4096];
    snprintf(buf, sizeof buf, "%s", spec ? spec : "");
    char *save = NULL;
    for (char *item = strtok_r(buf, ",", &save); item && p.ngpus < MAX_GPUS;
         item = strtok_r(NULL, ",", &save)) {
        char *eq = strchr(item, '=');
        if (!eq) return -1;
        *eq = '\0';
        int g = find_gpu(gpus, ngpus, item);
        if (g < 0) return -1;  /* a GPU this node does not have */
        snprintf(p.uuid[p.ngpus], MAX_TEXT, "%s", item);
        snprintf(p.chip[p.ngpus], MAX_TEXT, "%s", gpus[g].name);
        p.bytes[p.ngpus++] = strtoull(eq + 1, NULL, 10);
    }
    p.start = start_time((int)getpid());
    int fd = lock_dir();
    if (fd < 0) return -1;
    int rc = save_proc((int)getpid(), &p);
    char marker[4200];
    if (!rc && state_path((int)getpid(), marker, sizeof marker - 8) == 0) {
        strcat(marker, ".mps");
        if (strcmp(env("FAKECUDA_MPS_CLIENT", "0"), "1") == 0) {
            FILE *f = fopen(marker, "we");
            if (!f) rc = -1;
            else { fprintf(f, "%llu\n", p.start); fclose(f); }
        } else {
            unlink(marker);  /* a former process with this PID */
        }
    }
    unlock_dir(fd);
    return rc ? -1 : 0;
}

/* Whether `pid` (with state `p`) registered as an MPS client: its marker names its start. */
static int mps_client(int pid, const struct proc *p) {
    char path[4200];
    if (state_path(pid, path, sizeof path - 8)) return 0;
    strcat(path, ".mps");
    FILE *f = fopen(path, "re");
    if (!f) return 0;
    unsigned long long start = 0;
    int ok = fscanf(f, "%llu", &start) == 1 && start == p->start;
    fclose(f);
    return ok;
}

/* -- NVML: the calls cairn.process.gpus makes through pynvml ------------------------------ */

typedef int nvmlReturn_t;
#define NVML_SUCCESS 0
#define NVML_ERROR_UNINITIALIZED 1
#define NVML_ERROR_INVALID_ARGUMENT 2
#define NVML_ERROR_INSUFFICIENT_SIZE 7
#define NVML_ERROR_UNKNOWN 999

typedef struct { unsigned long long total, free, used; } nvmlMemory_t;
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId, computeInstanceId;
} nvmlProcessInfo_t;  /* nvmlProcessInfo_v2_t == v3 in nvml.h */
typedef struct gpu *nvmlDevice_t;

static struct gpu nvml_gpus[MAX_GPUS];
static int nvml_count = -1;

nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    if (injected_failure("nvmlInit")) return injected_failure("nvmlInit");
    nvml_count = load_gpus(nvml_gpus);
    return NVML_SUCCESS;
}
nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
nvmlReturn_t nvmlShutdown(void) { nvml_count = -1; return NVML_SUCCESS; }

const char *nvmlErrorString(nvmlReturn_t r) {
    switch (r) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    default: return "Unknown Error";
    }
}

static nvmlReturn_t copy_text(const char *text, char *out, unsigned int len) {
    if (nvml_count < 0) return NVML_ERROR_UNINITIALIZED;
    if (!out) return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(text) + 1 > len) return NVML_ERROR_INSUFFICIENT_SIZE;
    strcpy(out, text);
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *out, unsigned int len) {
    return copy_text(env("FAKECUDA_DRIVER", "580.65.06"), out, len);
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *version) {
    if (nvml_count < 0) return NVML_ERROR_UNINITIALIZED;
    return cuDriverGetVersion(version) ? NVML_ERROR_INVALID_ARGUMENT : NVML_SUCCESS;
}
nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *v) { return nvmlSystemGetCudaDriverVersion(v); }

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    if (nvml_count < 0) return NVML_ERROR_UNINITIALIZED;
    *count = (unsigned int)nvml_count;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    if (nvml_count < 0) return NVML_ERROR_UNINITIALIZED;
    if ((int)index >= nvml_count || !device) return NVML_ERROR_INVALID_ARGUMENT;
    *device = &nvml_gpus[index];
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t d, char *out, unsigned int len) {
    return d ? copy_text(d->uuid, out, len) : NVML_ERROR_INVALID_ARGUMENT;
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t d, char *out, unsigned int len) {
    return d ? copy_text(d->name, out, len) : NVML_ERROR_INVALID_ARGUMENT;
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t d, nvmlMemory_t *m) {
    if (nvml_count < 0) return NVML_ERROR_UNINITIALIZED;
    if (!d || !m) return NVML_ERROR_INVALID_ARGUMENT;
    unsigned long long used = d->used + held_on(d->uuid, -1);
    m->total = d->total;
    m->used = used < d->total ? used : d->total;
    m->free = d->total - m->used;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetCudaComputeCapability(nvmlDevice_t d, int *major, int *minor) {
    if (nvml_count < 0) return NVML_ERROR_UNINITIALIZED;
    if (!d || !major || !minor) return NVML_ERROR_INVALID_ARGUMENT;
    *major = d->cc_major;
    *minor = d->cc_minor;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t d, unsigned int *current, unsigned int *pending) {
    if (nvml_count < 0) return NVML_ERROR_UNINITIALIZED;
    if (!d || !current || !pending) return NVML_ERROR_INVALID_ARGUMENT;
    *current = *pending = (unsigned int)d->mig;
    return NVML_SUCCESS;
}

/* The registered processes with memory on `d` that are (mps) or are not MPS clients. */
static nvmlReturn_t running_processes(nvmlDevice_t d, unsigned int *count,
                                      nvmlProcessInfo_t *infos, int mps) {
    if (nvml_count < 0) return NVML_ERROR_UNINITIALIZED;
    if (!d || !count) return NVML_ERROR_INVALID_ARGUMENT;
    const char *dir = getenv("FAKECUDA_STATE_DIR");
    unsigned int n = 0, cap = *count;
    if (dir && *dir) {
        DIR *dd = opendir(dir);
        struct dirent *e;
        while (dd && (e = readdir(dd)) != NULL) {
            if (!isdigit((unsigned char)e->d_name[0]) || strchr(e->d_name, '.')) continue;
            struct proc p;
            int pid = atoi(e->d_name);
            if (load_proc(pid, &p) || p.state == CU_PROCESS_STATE_CHECKPOINTED) continue;
            if (mps_client(pid, &p) != mps) continue;
            for (int i = 0; i < p.ngpus; i++) {
                if (strcasecmp(p.uuid[i], d->uuid) != 0) continue;
                if (infos && n < cap) {
                    infos[n].pid = (unsigned int)pid;
                    infos[n].usedGpuMemory = p.bytes[i];
                    infos[n].gpuInstanceId = infos[n].computeInstanceId = 0xFFFFFFFFu;
                }
                n++;
            }
        }
        if (dd) closedir(dd);
    }
    *count = n;
    if (n > cap || (n && !infos)) return NVML_ERROR_INSUFFICIENT_SIZE;
    return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t d, unsigned int *count,
                                                     nvmlProcessInfo_t *infos) {
    return running_processes(d, count, infos, 0);
}

nvmlReturn_t nvmlDeviceGetMPSComputeRunningProcesses_v3(nvmlDevice_t d, unsigned int *count,
                                                        nvmlProcessInfo_t *infos) {
    return running_processes(d, count, infos, 1);
}
