/*
 * stub_nvml.c - a stub libnvidia-ml.so.1 for healthagent's tests, demo and benchmarks.
 *
 * It is a FAKE DRIVER, never a real one: it implements the NVML entry points that
 * healthagent/sources/nvml.py reaches through the official nvidia-ml-py bindings (pynvml), with
 * NVML's real signatures, struct layouts and return codes, and answers them from a JSON scenario
 * file instead of a GPU. What it leaves out: every NVML call the agent does not make, process and
 * utilisation queries, MIG instance management (events carry GPU/compute instance ids, that is all)
 * and any real timing behaviour of the driver.
 *
 * The scenario file is named by env HEALTHAGENT_STUB_NVML_SCENARIO when nvmlInit runs. The calls that
 * start a read (device count, handles, driver version, event calls) stat() it, per-field calls at
 * most once a millisecond, and it is re-read when (inode, size, mtime) changed, so a test,
 * the demo or a benchmark can change a running agent's GPUs: counters, GPU_IS_LOST, NOT_SUPPORTED
 * functions, the device count, and XID events. A file that does not parse or validate is rejected with a line
 * on stderr; the last good scenario stays in force (and is counted: stubNvmlStats).
 *
 * Events: each event in the file has a unique positive id. An event set created at some moment
 * delivers, through nvmlEventSetWait_v2, each event whose id is above the largest id present when the
 * set was created, once, in id order, if it was registered for that GPU and event type. The wait
 * sleeps until the scenario's folder changes (inotify) or its timeout passes, as a driver sleeps
 * until an interrupt: an idle agent costs no CPU here. Where inotify is unavailable it falls back to
 * looking every few milliseconds.
 *
 * Build: cc -shared -fPIC -Wl,-soname,libnvidia-ml.so.1 -pthread -o libnvidia-ml.so.1 stub_nvml.c
 * Thread-safe: one mutex guards all state; nvmlEventSetWait_v2 sleeps without holding it.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <libgen.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/inotify.h>
#include <sys/stat.h>
#include <unistd.h>
#include <time.h>

#define EXPORT __attribute__((visibility("default")))

/* ---- NVML types and constants (values from nvml.h / pynvml) ----------------------------------- */

typedef int nvmlReturn_t;
enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NO_PERMISSION = 4,
    NVML_ERROR_ALREADY_INITIALIZED = 5,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_INSUFFICIENT_POWER = 8,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_TIMEOUT = 10,
    NVML_ERROR_IRQ_ISSUE = 11,
    NVML_ERROR_LIBRARY_NOT_FOUND = 12,
    NVML_ERROR_FUNCTION_NOT_FOUND = 13,
    NVML_ERROR_CORRUPTED_INFOROM = 14,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_RESET_REQUIRED = 16,
    NVML_ERROR_OPERATING_SYSTEM = 17,
    NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18,
    NVML_ERROR_IN_USE = 19,
    NVML_ERROR_MEMORY = 20,
    NVML_ERROR_NO_DATA = 21,
    NVML_ERROR_VGPU_ECC_NOT_SUPPORTED = 22,
    NVML_ERROR_INSUFFICIENT_RESOURCES = 23,
    NVML_ERROR_UNKNOWN = 999,
};

#define NVML_EVENT_SBE 0x1ULL   /* nvmlEventTypeSingleBitEccError */
#define NVML_EVENT_DBE 0x2ULL   /* nvmlEventTypeDoubleBitEccError */
#define NVML_EVENT_XID 0x8ULL   /* nvmlEventTypeXidCriticalError */
#define NVML_VALUE_NOT_AVAILABLE_UINT 0xFFFFFFFFu

#define STUB_MAX_GPUS 64
#define STUB_MAX_LINKS 36 /* NVML_NVLINK_MAX_LINKS */
#define STUB_NVLINK_COUNTERS 5 /* replay, recovery, crc_flit, crc_data, ecc_data */
#define STUB_MAX_EVENT_SETS 64
#define STUB_MAX_EVENTS 200000
#define STUB_MAX_RETIRED_PAGES 4096
#define STUB_MAX_FILE_BYTES (64L * 1024 * 1024)
#define STUB_MAX_JSON_DEPTH 32
#define STUB_MAX_JSON_NODES 4000000
#define STUB_POLL_NS 5000000L /* 5 ms between looks inside nvmlEventSetWait_v2 without inotify */
#define STUB_FIELD_RECHECK_NS 1000000LL /* per-field calls re-check the file at most every 1 ms */

typedef struct stub_device *nvmlDevice_t;
typedef struct stub_event_set *nvmlEventSet_t;

typedef struct {
    char busIdLegacy[16];
    unsigned int domain;
    unsigned int bus;
    unsigned int device;
    unsigned int pciDeviceId;
    unsigned int pciSubSystemId;
    char busId[32];
} nvmlPciInfo_t;

typedef struct {
    nvmlDevice_t device;
    unsigned long long eventType;
    unsigned long long eventData;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlEventData_t;

/* Functions a scenario can make answer NOT_SUPPORTED, by their NVML name. */
enum {
    FN_ECC = 1u << 0,
    FN_REMAPPED_ROWS = 1u << 1,
    FN_RETIRED_PAGES = 1u << 2,
    FN_RETIRED_PAGES_PENDING = 1u << 3,
    FN_CLOCKS_EVENT_REASONS = 1u << 4,
    FN_NVLINK_STATE = 1u << 5,
    FN_NVLINK_ERRORS = 1u << 6,
    FN_TEMPERATURE = 1u << 7,
    FN_POWER = 1u << 8,
    FN_PCIE_REPLAY = 1u << 9,
    FN_EVENTS = 1u << 10,
    FN_MIG_MODE = 1u << 11,
    FN_NONE = 0,
};

static const struct {
    const char *name;
    unsigned bit;
} FUNCTION_NAMES[] = {
    {"nvmlDeviceGetTotalEccErrors", FN_ECC},
    {"nvmlDeviceGetRemappedRows", FN_REMAPPED_ROWS},
    {"nvmlDeviceGetRetiredPages", FN_RETIRED_PAGES},
    {"nvmlDeviceGetRetiredPages_v2", FN_RETIRED_PAGES},
    {"nvmlDeviceGetRetiredPagesPendingStatus", FN_RETIRED_PAGES_PENDING},
    {"nvmlDeviceGetCurrentClocksEventReasons", FN_CLOCKS_EVENT_REASONS},
    {"nvmlDeviceGetCurrentClocksThrottleReasons", FN_CLOCKS_EVENT_REASONS},
    {"nvmlDeviceGetNvLinkState", FN_NVLINK_STATE},
    {"nvmlDeviceGetNvLinkErrorCounter", FN_NVLINK_ERRORS},
    {"nvmlDeviceGetTemperature", FN_TEMPERATURE},
    {"nvmlDeviceGetPowerUsage", FN_POWER},
    {"nvmlDeviceGetPcieReplayCounter", FN_PCIE_REPLAY},
    {"nvmlDeviceGetSupportedEventTypes", FN_EVENTS},
    {"nvmlDeviceRegisterEvents", FN_EVENTS},
    {"nvmlDeviceGetMigMode", FN_MIG_MODE},
};

/* ---- the scenario ------------------------------------------------------------------------------ */

typedef struct {
    char uuid[96];
    char name[96];
    char bus_id[32];        /* NVML form 00000000:53:00.0 */
    char bus_id_legacy[16]; /* 0000:53:00.0 */
    unsigned domain, bus, device;
    unsigned pci_device_id, pci_subsystem_id;
    int lost;
    unsigned not_supported;
    unsigned long long ecc[2][2]; /* [corrected, uncorrected][volatile, aggregate] */
    unsigned remap_correctable, remap_uncorrectable, remap_pending, remap_failure;
    unsigned retired[2]; /* [multiple single-bit, double-bit] */
    unsigned retired_pending;
    unsigned long long clocks_event_reasons;
    unsigned nvlink_links;
    unsigned long long nvlink_inactive; /* bit per link */
    unsigned long long nvlink[STUB_NVLINK_COUNTERS][STUB_MAX_LINKS];
    unsigned pcie_replay, temperature_c, power_mw;
    unsigned long long supported_events;
    unsigned mig_mode;
    unsigned long long uuid_hash;
} stub_gpu;

typedef struct {
    unsigned long long id;
    unsigned gpu;
    unsigned long long type;
    unsigned long long data;
    unsigned gpu_instance, compute_instance;
} stub_event;

typedef struct {
    char driver_version[80];
    unsigned n_gpus;
    stub_gpu gpus[STUB_MAX_GPUS];
    size_t n_events;
    stub_event *events; /* sorted by id */
} stub_scenario;

struct stub_device {
    unsigned index;
};

struct stub_event_set {
    int in_use;
    int watch; /* inotify descriptor on the scenario's folder, or -1 (see watch_scenario_folder) */
    dev_t watch_dev; /* the folder it watches, so a freed set's descriptor can serve the next set */
    ino_t watch_ino;
    unsigned long long last_id;
    unsigned long long mask[STUB_MAX_GPUS];
    unsigned long long uuid_hash[STUB_MAX_GPUS];
};

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static void release_set(struct stub_event_set *s);
static int watch_scenario_folder(struct stub_event_set *s);
static int g_refcount;
static char g_path[4096];
static stub_scenario *g_scenario;
static struct {
    int valid;
    dev_t dev;
    ino_t ino;
    off_t size;
    struct timespec mtim;
} g_seen;
static long long g_last_check_ns;
static unsigned long long g_loads, g_rejects;
static char g_last_error[512];
static struct stub_device g_devices[STUB_MAX_GPUS];
static struct stub_event_set g_sets[STUB_MAX_EVENT_SETS];
/* Inotify descriptors of freed event sets, each still watching its folder (see release_set). */
static struct {
    int fd;
    dev_t dev;
    ino_t ino;
} g_spare_watches[STUB_MAX_EVENT_SETS];
static int g_spare_count;

/* ---- a small strict JSON reader (RFC 8259; depth, size and node count bounded) ----------------- */

typedef enum { J_NULL, J_BOOL, J_NUM, J_STR, J_ARR, J_OBJ } jtype;

typedef struct jnode {
    jtype type;
    char *key;        /* member name when inside an object */
    int boolean;
    int is_uint;      /* number is a non-negative integer that fits in 64 bits */
    unsigned long long uint_value;
    char *str;
    struct jnode *kids;
    size_t n_kids;
} jnode;

typedef struct {
    const char *start, *p, *end;
    size_t nodes;
    char err[256];
} jparser;

static int jfail(jparser *ps, const char *what) {
    if (!ps->err[0])
        snprintf(ps->err, sizeof ps->err, "JSON error at byte %ld: %s", (long)(ps->p - ps->start), what);
    return -1;
}

static void jskip_ws(jparser *ps) {
    while (ps->p < ps->end && (*ps->p == ' ' || *ps->p == '\t' || *ps->p == '\n' || *ps->p == '\r'))
        ps->p++;
}

static void jfree(jnode *n) {
    if (!n)
        return;
    for (size_t i = 0; i < n->n_kids; i++)
        jfree(&n->kids[i]);
    free(n->kids);
    free(n->str);
    free(n->key);
    n->kids = NULL;
    n->str = NULL;
    n->key = NULL;
    n->n_kids = 0;
}

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

static int jread_hex4(jparser *ps, unsigned *out) {
    if (ps->end - ps->p < 4)
        return jfail(ps, "truncated \\u escape");
    unsigned v = 0;
    for (int i = 0; i < 4; i++) {
        int h = hexval(ps->p[i]);
        if (h < 0)
            return jfail(ps, "bad hex digit in \\u escape");
        v = v * 16 + (unsigned)h;
    }
    ps->p += 4;
    *out = v;
    return 0;
}

/* Length of the valid UTF-8 sequence at p (no overlongs, surrogates or > U+10FFFF); 0 if invalid. */
static int utf8_sequence_length(const unsigned char *p, const unsigned char *end) {
    unsigned c = p[0], cp;
    int n;
    if (c < 0x80)
        return 1;
    if (c >= 0xC2 && c <= 0xDF) {
        n = 2;
        cp = c & 0x1F;
    } else if (c >= 0xE0 && c <= 0xEF) {
        n = 3;
        cp = c & 0x0F;
    } else if (c >= 0xF0 && c <= 0xF4) {
        n = 4;
        cp = c & 0x07;
    } else {
        return 0;
    }
    if (end - p < n)
        return 0;
    for (int i = 1; i < n; i++) {
        if ((p[i] & 0xC0) != 0x80)
            return 0;
        cp = (cp << 6) | (p[i] & 0x3F);
    }
    if ((n == 3 && cp < 0x800) || (n == 4 && (cp < 0x10000 || cp > 0x10FFFF)) || (cp >= 0xD800 && cp <= 0xDFFF))
        return 0;
    return n;
}

/* Parses a string starting at the opening quote; the result is NUL-terminated UTF-8. */
static int jparse_string(jparser *ps, char **out) {
    ps->p++; /* opening quote */
    size_t cap = 16, len = 0;
    char *buf = malloc(cap);
    if (!buf)
        return jfail(ps, "out of memory");
    for (;;) {
        if (ps->p >= ps->end) {
            free(buf);
            return jfail(ps, "unterminated string");
        }
        unsigned char c = (unsigned char)*ps->p;
        char enc[4];
        size_t n_enc = 0;
        if (c == '"') {
            ps->p++;
            break;
        } else if (c < 0x20) {
            free(buf);
            return jfail(ps, "control character in string");
        } else if (c == '\\') {
            ps->p++;
            if (ps->p >= ps->end) {
                free(buf);
                return jfail(ps, "unterminated escape");
            }
            char e = *ps->p++;
            unsigned cp;
            switch (e) {
            case '"': enc[0] = '"'; n_enc = 1; break;
            case '\\': enc[0] = '\\'; n_enc = 1; break;
            case '/': enc[0] = '/'; n_enc = 1; break;
            case 'b': enc[0] = '\b'; n_enc = 1; break;
            case 'f': enc[0] = '\f'; n_enc = 1; break;
            case 'n': enc[0] = '\n'; n_enc = 1; break;
            case 'r': enc[0] = '\r'; n_enc = 1; break;
            case 't': enc[0] = '\t'; n_enc = 1; break;
            case 'u':
                if (jread_hex4(ps, &cp)) {
                    free(buf);
                    return -1;
                }
                if (cp >= 0xD800 && cp <= 0xDBFF) {
                    unsigned lo;
                    if (ps->end - ps->p < 2 || ps->p[0] != '\\' || ps->p[1] != 'u') {
                        free(buf);
                        return jfail(ps, "unpaired surrogate in \\u escape");
                    }
                    ps->p += 2;
                    if (jread_hex4(ps, &lo)) {
                        free(buf);
                        return -1;
                    }
                    if (lo < 0xDC00 || lo > 0xDFFF) {
                        free(buf);
                        return jfail(ps, "bad low surrogate in \\u escape");
                    }
                    cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
                    free(buf);
                    return jfail(ps, "unpaired low surrogate in \\u escape");
                }
                if (cp == 0) {
                    free(buf);
                    return jfail(ps, "\\u0000 is not allowed in a scenario string");
                }
                if (cp < 0x80) {
                    enc[0] = (char)cp;
                    n_enc = 1;
                } else if (cp < 0x800) {
                    enc[0] = (char)(0xC0 | (cp >> 6));
                    enc[1] = (char)(0x80 | (cp & 0x3F));
                    n_enc = 2;
                } else if (cp < 0x10000) {
                    enc[0] = (char)(0xE0 | (cp >> 12));
                    enc[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
                    enc[2] = (char)(0x80 | (cp & 0x3F));
                    n_enc = 3;
                } else {
                    enc[0] = (char)(0xF0 | (cp >> 18));
                    enc[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
                    enc[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
                    enc[3] = (char)(0x80 | (cp & 0x3F));
                    n_enc = 4;
                }
                break;
            default:
                ps->p--;
                free(buf);
                return jfail(ps, "unknown escape in string");
            }
        } else {
            int n = utf8_sequence_length((const unsigned char *)ps->p, (const unsigned char *)ps->end);
            if (n == 0) {
                free(buf);
                return jfail(ps, "invalid UTF-8 in string");
            }
            memcpy(enc, ps->p, (size_t)n);
            n_enc = (size_t)n;
            ps->p += n;
        }
        if (len + n_enc + 1 > cap) {
            while (len + n_enc + 1 > cap)
                cap *= 2;
            char *grown = realloc(buf, cap);
            if (!grown) {
                free(buf);
                return jfail(ps, "out of memory");
            }
            buf = grown;
        }
        memcpy(buf + len, enc, n_enc);
        len += n_enc;
    }
    buf[len] = '\0';
    *out = buf;
    return 0;
}

static int jparse_number(jparser *ps, jnode *n) {
    const char *s = ps->p;
    int negative = 0, integral = 1;
    if (ps->p < ps->end && *ps->p == '-') {
        negative = 1;
        ps->p++;
    }
    if (ps->p >= ps->end || *ps->p < '0' || *ps->p > '9')
        return jfail(ps, "bad number");
    if (*ps->p == '0') {
        ps->p++;
        if (ps->p < ps->end && *ps->p >= '0' && *ps->p <= '9')
            return jfail(ps, "leading zero in number");
    } else {
        while (ps->p < ps->end && *ps->p >= '0' && *ps->p <= '9')
            ps->p++;
    }
    const char *int_end = ps->p;
    if (ps->p < ps->end && *ps->p == '.') {
        integral = 0;
        ps->p++;
        if (ps->p >= ps->end || *ps->p < '0' || *ps->p > '9')
            return jfail(ps, "bad fraction in number");
        while (ps->p < ps->end && *ps->p >= '0' && *ps->p <= '9')
            ps->p++;
    }
    if (ps->p < ps->end && (*ps->p == 'e' || *ps->p == 'E')) {
        integral = 0;
        ps->p++;
        if (ps->p < ps->end && (*ps->p == '+' || *ps->p == '-'))
            ps->p++;
        if (ps->p >= ps->end || *ps->p < '0' || *ps->p > '9')
            return jfail(ps, "bad exponent in number");
        while (ps->p < ps->end && *ps->p >= '0' && *ps->p <= '9')
            ps->p++;
    }
    n->type = J_NUM;
    n->is_uint = 0;
    if (integral && !negative) {
        unsigned long long v = 0;
        int overflow = 0;
        for (const char *q = s; q < int_end; q++) {
            unsigned d = (unsigned)(*q - '0');
            if (v > (ULLONG_MAX - d) / 10) {
                overflow = 1;
                break;
            }
            v = v * 10 + d;
        }
        if (!overflow) {
            n->is_uint = 1;
            n->uint_value = v;
        }
    }
    return 0;
}

static int jparse_value(jparser *ps, jnode *n, int depth);

static int jpush(jparser *ps, jnode **kids, size_t *len, size_t *cap) {
    if (++ps->nodes > STUB_MAX_JSON_NODES)
        return jfail(ps, "too many JSON values");
    if (*len == *cap) {
        size_t ncap = *cap ? *cap * 2 : 4;
        jnode *grown = realloc(*kids, ncap * sizeof **kids);
        if (!grown)
            return jfail(ps, "out of memory");
        *kids = grown;
        *cap = ncap;
    }
    memset(&(*kids)[*len], 0, sizeof **kids);
    (*len)++;
    return 0;
}

static int jparse_container(jparser *ps, jnode *n, int depth, int is_object) {
    char close = is_object ? '}' : ']';
    size_t cap = 0;
    n->type = is_object ? J_OBJ : J_ARR;
    ps->p++;
    jskip_ws(ps);
    if (ps->p < ps->end && *ps->p == close) {
        ps->p++;
        return 0;
    }
    for (;;) {
        if (jpush(ps, &n->kids, &n->n_kids, &cap))
            return -1;
        jnode *kid = &n->kids[n->n_kids - 1];
        jskip_ws(ps);
        if (is_object) {
            if (ps->p >= ps->end || *ps->p != '"')
                return jfail(ps, "expected a member name");
            if (jparse_string(ps, &kid->key))
                return -1;
            for (size_t i = 0; i + 1 < n->n_kids; i++)
                if (strcmp(n->kids[i].key, kid->key) == 0)
                    return jfail(ps, "duplicate member name");
            jskip_ws(ps);
            if (ps->p >= ps->end || *ps->p != ':')
                return jfail(ps, "expected ':'");
            ps->p++;
        }
        if (jparse_value(ps, kid, depth + 1))
            return -1;
        jskip_ws(ps);
        if (ps->p >= ps->end)
            return jfail(ps, is_object ? "unterminated object" : "unterminated array");
        if (*ps->p == ',') {
            ps->p++;
            continue;
        }
        if (*ps->p == close) {
            ps->p++;
            return 0;
        }
        return jfail(ps, is_object ? "expected ',' or '}'" : "expected ',' or ']'");
    }
}

static int jliteral(jparser *ps, const char *word) {
    size_t len = strlen(word);
    if ((size_t)(ps->end - ps->p) < len || memcmp(ps->p, word, len) != 0)
        return jfail(ps, "unexpected character");
    ps->p += len;
    return 0;
}

static int jparse_value(jparser *ps, jnode *n, int depth) {
    if (depth > STUB_MAX_JSON_DEPTH)
        return jfail(ps, "nested too deeply");
    jskip_ws(ps);
    if (ps->p >= ps->end)
        return jfail(ps, "unexpected end of input");
    switch (*ps->p) {
    case '{': return jparse_container(ps, n, depth, 1);
    case '[': return jparse_container(ps, n, depth, 0);
    case '"': n->type = J_STR; return jparse_string(ps, &n->str);
    case 't': n->type = J_BOOL; n->boolean = 1; return jliteral(ps, "true");
    case 'f': n->type = J_BOOL; n->boolean = 0; return jliteral(ps, "false");
    case 'n': n->type = J_NULL; return jliteral(ps, "null");
    default: return jparse_number(ps, n);
    }
}

static int jparse_document(const char *text, size_t len, jnode *root, char *err, size_t errlen) {
    jparser ps = {text, text, text + len, 0, {0}};
    memset(root, 0, sizeof *root);
    int rc = jparse_value(&ps, root, 0);
    if (rc == 0) {
        jskip_ws(&ps);
        if (ps.p != ps.end)
            rc = jfail(&ps, "trailing characters after the document");
    }
    if (rc) {
        snprintf(err, errlen, "%s", ps.err);
        jfree(root);
    }
    return rc;
}

/* ---- scenario validation: strict, every key known, every value typed and bounded --------------- */

typedef struct {
    char err[256];
} vctx;

static int vfail(vctx *v, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int vfail(vctx *v, const char *fmt, ...) {
    if (!v->err[0]) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(v->err, sizeof v->err, fmt, ap);
        va_end(ap);
    }
    return -1;
}

static int vuint(vctx *v, const char *where, const jnode *n, unsigned long long max, unsigned long long *out) {
    if (n->type != J_NUM || !n->is_uint || n->uint_value > max)
        return vfail(v, "%s: expected an integer from 0 to %llu", where, max);
    *out = n->uint_value;
    return 0;
}

static int vuint32(vctx *v, const char *where, const jnode *n, unsigned max, unsigned *out) {
    unsigned long long x = 0;
    if (vuint(v, where, n, max, &x))
        return -1;
    *out = (unsigned)x;
    return 0;
}

static int vbool(vctx *v, const char *where, const jnode *n, unsigned *out) {
    if (n->type != J_BOOL)
        return vfail(v, "%s: expected true or false", where);
    *out = (unsigned)n->boolean;
    return 0;
}

static int vstr(vctx *v, const char *where, const jnode *n, char *out, size_t cap) {
    if (n->type != J_STR)
        return vfail(v, "%s: expected a string", where);
    if (strlen(n->str) >= cap)
        return vfail(v, "%s: longer than %zu bytes", where, cap - 1);
    strcpy(out, n->str);
    return 0;
}

static unsigned long long fnv1a(const char *s) {
    unsigned long long h = 1469598103934665603ULL;
    for (; *s; s++) {
        h ^= (unsigned char)*s;
        h *= 1099511628211ULL;
    }
    return h;
}

/* Parses exactly dddd:bb:dd.f or dddddddd:bb:dd.f (hex, either case); no signs, spaces or 0x. */
static int parse_hex_run(const char **p, int min_digits, int max_digits, unsigned *out) {
    unsigned v = 0;
    int n = 0;
    for (; n < max_digits && hexval(**p) >= 0; n++, (*p)++)
        v = v * 16 + (unsigned)hexval(**p);
    *out = v;
    return n >= min_digits && hexval(**p) < 0;
}

static int vpci(vctx *v, const char *where, const jnode *n, stub_gpu *g) {
    char text[32];
    unsigned domain, bus, dev, fn;
    if (vstr(v, where, n, text, sizeof text))
        return -1;
    const char *p = text;
    int ok = parse_hex_run(&p, 4, 8, &domain) && *p++ == ':' && parse_hex_run(&p, 2, 2, &bus) && *p++ == ':' &&
             parse_hex_run(&p, 2, 2, &dev) && *p++ == '.' && parse_hex_run(&p, 1, 1, &fn) && *p == '\0';
    if (!ok || fn > 7 || dev > 0x1f)
        return vfail(v, "%s: expected a PCI bus id like 00000000:53:00.0, got \"%s\"", where, text);
    g->domain = domain;
    g->bus = bus;
    g->device = dev;
    snprintf(g->bus_id, sizeof g->bus_id, "%08X:%02X:%02X.%X", domain, bus, dev, fn);
    snprintf(g->bus_id_legacy, sizeof g->bus_id_legacy, "%04X:%02X:%02X.%X", domain & 0xFFFF, bus, dev, fn);
    return 0;
}

static int vcounter_array(vctx *v, const char *where, const jnode *n, unsigned long long *out) {
    if (n->type != J_ARR)
        return vfail(v, "%s: expected an array of per-link counters", where);
    if (n->n_kids > STUB_MAX_LINKS)
        return vfail(v, "%s: more than %d links", where, STUB_MAX_LINKS);
    for (size_t i = 0; i < n->n_kids; i++) {
        char w[192];
        snprintf(w, sizeof w, "%s[%zu]", where, i);
        if (vuint(v, w, &n->kids[i], ULLONG_MAX, &out[i]))
            return -1;
    }
    return 0;
}

static const char *NVLINK_COUNTER_KEYS[STUB_NVLINK_COUNTERS] = {
    "nvlink_replay", "nvlink_recovery", "nvlink_crc_flit", "nvlink_crc_data", "nvlink_ecc_data"};

static int vgpu(vctx *v, unsigned index, const jnode *obj, stub_gpu *g) {
    char where[128];
    int have_uuid = 0, have_name = 0, have_pci = 0;
    size_t nvlink_lengths[STUB_NVLINK_COUNTERS] = {0};
    if (obj->type != J_OBJ)
        return vfail(v, "gpus[%u]: expected an object", index);
    memset(g, 0, sizeof *g);
    g->pci_device_id = 0x233010DE;
    g->supported_events = NVML_EVENT_SBE | NVML_EVENT_DBE | 0x4 | NVML_EVENT_XID | 0x10;
    for (size_t i = 0; i < obj->n_kids; i++) {
        const jnode *n = &obj->kids[i];
        const char *k = n->key;
        unsigned long long u = 0;
        snprintf(where, sizeof where, "gpus[%u].%s", index, k);
        int rc = 0;
        if (k[0] == '_') continue; /* comments */
        else if (!strcmp(k, "uuid")) { rc = vstr(v, where, n, g->uuid, sizeof g->uuid); have_uuid = 1; }
        else if (!strcmp(k, "name")) { rc = vstr(v, where, n, g->name, sizeof g->name); have_name = 1; }
        else if (!strcmp(k, "pci_bus_id")) { rc = vpci(v, where, n, g); have_pci = 1; }
        else if (!strcmp(k, "pci_device_id")) rc = vuint32(v, where, n, 0xFFFFFFFFu, &g->pci_device_id);
        else if (!strcmp(k, "pci_subsystem_id")) rc = vuint32(v, where, n, 0xFFFFFFFFu, &g->pci_subsystem_id);
        else if (!strcmp(k, "lost")) { unsigned b = 0; rc = vbool(v, where, n, &b); g->lost = (int)b; }
        else if (!strcmp(k, "not_supported")) {
            if (n->type != J_ARR) { rc = vfail(v, "%s: expected an array of NVML function names", where); }
            for (size_t j = 0; rc == 0 && j < n->n_kids; j++) {
                const jnode *f = &n->kids[j];
                unsigned bit = FN_NONE;
                if (f->type == J_STR)
                    for (size_t t = 0; t < sizeof FUNCTION_NAMES / sizeof FUNCTION_NAMES[0]; t++)
                        if (!strcmp(FUNCTION_NAMES[t].name, f->str)) bit = FUNCTION_NAMES[t].bit;
                if (bit == FN_NONE)
                    rc = vfail(v, "%s[%zu]: not an NVML function this stub implements", where, j);
                g->not_supported |= bit;
            }
        }
        else if (!strcmp(k, "ecc_volatile_corrected")) rc = vuint(v, where, n, ULLONG_MAX, &g->ecc[0][0]);
        else if (!strcmp(k, "ecc_aggregate_corrected")) rc = vuint(v, where, n, ULLONG_MAX, &g->ecc[0][1]);
        else if (!strcmp(k, "ecc_volatile_uncorrected")) rc = vuint(v, where, n, ULLONG_MAX, &g->ecc[1][0]);
        else if (!strcmp(k, "ecc_aggregate_uncorrected")) rc = vuint(v, where, n, ULLONG_MAX, &g->ecc[1][1]);
        else if (!strcmp(k, "remapped_rows_correctable")) rc = vuint32(v, where, n, 0xFFFFFFFFu, &g->remap_correctable);
        else if (!strcmp(k, "remapped_rows_uncorrectable")) rc = vuint32(v, where, n, 0xFFFFFFFFu, &g->remap_uncorrectable);
        else if (!strcmp(k, "remap_pending")) rc = vbool(v, where, n, &g->remap_pending);
        else if (!strcmp(k, "remap_failure")) rc = vbool(v, where, n, &g->remap_failure);
        else if (!strcmp(k, "retired_pages_single_bit")) rc = vuint32(v, where, n, STUB_MAX_RETIRED_PAGES, &g->retired[0]);
        else if (!strcmp(k, "retired_pages_double_bit")) rc = vuint32(v, where, n, STUB_MAX_RETIRED_PAGES, &g->retired[1]);
        else if (!strcmp(k, "retired_pages_pending")) rc = vbool(v, where, n, &g->retired_pending);
        else if (!strcmp(k, "clocks_event_reasons")) rc = vuint(v, where, n, ULLONG_MAX, &g->clocks_event_reasons);
        else if (!strcmp(k, "nvlink_links")) rc = vuint32(v, where, n, STUB_MAX_LINKS, &g->nvlink_links);
        else if (!strcmp(k, "nvlink_inactive")) {
            if (n->type != J_ARR) rc = vfail(v, "%s: expected an array of link numbers", where);
            for (size_t j = 0; rc == 0 && j < n->n_kids; j++) {
                char w[192];
                snprintf(w, sizeof w, "%s[%zu]", where, j);
                rc = vuint(v, w, &n->kids[j], STUB_MAX_LINKS - 1, &u);
                if (rc == 0) g->nvlink_inactive |= 1ULL << u;
            }
        }
        else if (!strcmp(k, "pcie_replay")) rc = vuint32(v, where, n, 0xFFFFFFFFu, &g->pcie_replay);
        else if (!strcmp(k, "temperature_c")) rc = vuint32(v, where, n, 1000, &g->temperature_c);
        else if (!strcmp(k, "power_mw")) rc = vuint32(v, where, n, 0xFFFFFFFFu, &g->power_mw);
        else if (!strcmp(k, "supported_events")) rc = vuint(v, where, n, ULLONG_MAX, &g->supported_events);
        else if (!strcmp(k, "mig_mode")) rc = vuint32(v, where, n, 1, &g->mig_mode);
        else {
            int matched = 0;
            for (int c = 0; c < STUB_NVLINK_COUNTERS; c++)
                if (!strcmp(k, NVLINK_COUNTER_KEYS[c])) {
                    matched = 1;
                    rc = vcounter_array(v, where, n, g->nvlink[c]);
                    nvlink_lengths[c] = n->n_kids;
                }
            if (!matched)
                rc = vfail(v, "%s: unknown key (see healthagent/demo/stub_nvml.py GPU_FIELDS)", where);
        }
        if (rc)
            return -1;
    }
    if (!have_uuid || !have_name || !have_pci)
        return vfail(v, "gpus[%u]: uuid, name and pci_bus_id are required", index);
    if (!g->uuid[0])
        return vfail(v, "gpus[%u].uuid: must not be empty", index);
    for (int c = 0; c < STUB_NVLINK_COUNTERS; c++)
        if (nvlink_lengths[c] > g->nvlink_links)
            return vfail(v, "gpus[%u].%s: %zu entries but nvlink_links is %u", index, NVLINK_COUNTER_KEYS[c],
                         nvlink_lengths[c], g->nvlink_links);
    g->uuid_hash = fnv1a(g->uuid);
    return 0;
}

static int vevent(vctx *v, size_t index, const jnode *obj, stub_event *e) {
    char where[96];
    int have_id = 0, have_gpu = 0, have_data = 0;
    if (obj->type != J_OBJ)
        return vfail(v, "events[%zu]: expected an object", index);
    memset(e, 0, sizeof *e);
    e->type = NVML_EVENT_XID;
    e->gpu_instance = NVML_VALUE_NOT_AVAILABLE_UINT;
    e->compute_instance = NVML_VALUE_NOT_AVAILABLE_UINT;
    for (size_t i = 0; i < obj->n_kids; i++) {
        const jnode *n = &obj->kids[i];
        const char *k = n->key;
        int rc = 0;
        snprintf(where, sizeof where, "events[%zu].%s", index, k);
        if (k[0] == '_') continue;
        else if (!strcmp(k, "id")) { rc = vuint(v, where, n, ULLONG_MAX, &e->id); have_id = 1; }
        else if (!strcmp(k, "gpu")) { rc = vuint32(v, where, n, STUB_MAX_GPUS - 1, &e->gpu); have_gpu = 1; }
        else if (!strcmp(k, "data")) { rc = vuint(v, where, n, ULLONG_MAX, &e->data); have_data = 1; }
        else if (!strcmp(k, "gpu_instance")) rc = vuint32(v, where, n, 0xFFFFFFFFu, &e->gpu_instance);
        else if (!strcmp(k, "compute_instance")) rc = vuint32(v, where, n, 0xFFFFFFFFu, &e->compute_instance);
        else if (!strcmp(k, "type")) {
            if (n->type == J_STR && !strcmp(n->str, "xid")) e->type = NVML_EVENT_XID;
            else if (n->type == J_STR && !strcmp(n->str, "sbe")) e->type = NVML_EVENT_SBE;
            else if (n->type == J_STR && !strcmp(n->str, "dbe")) e->type = NVML_EVENT_DBE;
            else if (n->type == J_NUM) rc = vuint(v, where, n, ULLONG_MAX, &e->type);
            else rc = vfail(v, "%s: expected \"xid\", \"sbe\", \"dbe\" or an nvmlEventType bit", where);
        }
        else rc = vfail(v, "%s: unknown key", where);
        if (rc)
            return -1;
    }
    if (!have_id || !have_gpu || !have_data)
        return vfail(v, "events[%zu]: id, gpu and data are required", index);
    if (e->id == 0)
        return vfail(v, "events[%zu].id: must be positive", index);
    return 0;
}

static int event_cmp(const void *a, const void *b) {
    const stub_event *x = a, *y = b;
    return x->id < y->id ? -1 : x->id > y->id;
}

static stub_scenario *build_scenario(const jnode *root, vctx *v) {
    if (root->type != J_OBJ) {
        vfail(v, "the scenario must be a JSON object");
        return NULL;
    }
    stub_scenario *s = calloc(1, sizeof *s);
    if (!s) {
        vfail(v, "out of memory");
        return NULL;
    }
    snprintf(s->driver_version, sizeof s->driver_version, "%s", "0.0.0-stub");
    int have_gpus = 0;
    for (size_t i = 0; i < root->n_kids; i++) {
        const jnode *n = &root->kids[i];
        const char *k = n->key;
        if (k[0] == '_')
            continue;
        if (!strcmp(k, "driver_version")) {
            if (vstr(v, "driver_version", n, s->driver_version, sizeof s->driver_version))
                goto fail;
        } else if (!strcmp(k, "gpus")) {
            have_gpus = 1;
            if (n->type != J_ARR) {
                vfail(v, "gpus: expected an array");
                goto fail;
            }
            if (n->n_kids > STUB_MAX_GPUS) {
                vfail(v, "gpus: at most %d GPUs", STUB_MAX_GPUS);
                goto fail;
            }
            for (size_t j = 0; j < n->n_kids; j++) {
                if (vgpu(v, (unsigned)j, &n->kids[j], &s->gpus[j]))
                    goto fail;
                for (size_t q = 0; q < j; q++)
                    if (!strcmp(s->gpus[q].uuid, s->gpus[j].uuid)) {
                        vfail(v, "gpus[%zu].uuid: same as gpus[%zu]", j, q);
                        goto fail;
                    }
            }
            s->n_gpus = (unsigned)n->n_kids;
        } else if (!strcmp(k, "events")) {
            if (n->type != J_ARR) {
                vfail(v, "events: expected an array");
                goto fail;
            }
            if (n->n_kids > STUB_MAX_EVENTS) {
                vfail(v, "events: at most %d events", STUB_MAX_EVENTS);
                goto fail;
            }
            if (n->n_kids) {
                s->events = calloc(n->n_kids, sizeof *s->events);
                if (!s->events) {
                    vfail(v, "out of memory");
                    goto fail;
                }
            }
            for (size_t j = 0; j < n->n_kids; j++)
                if (vevent(v, j, &n->kids[j], &s->events[j]))
                    goto fail;
            s->n_events = n->n_kids;
            if (s->n_events > 1)
                qsort(s->events, s->n_events, sizeof *s->events, event_cmp);
            for (size_t j = 1; j < s->n_events; j++)
                if (s->events[j].id == s->events[j - 1].id) {
                    vfail(v, "events: id %llu appears twice", s->events[j].id);
                    goto fail;
                }
        } else {
            vfail(v, "%s: unknown top-level key (driver_version, gpus, events)", k);
            goto fail;
        }
    }
    if (!have_gpus) {
        vfail(v, "gpus: required");
        goto fail;
    }
    return s;
fail:
    free(s->events);
    free(s);
    return NULL;
}

static void free_scenario(stub_scenario *s) {
    if (s) {
        free(s->events);
        free(s);
    }
}

/* ---- loading and reloading --------------------------------------------------------------------- */

static void note_error(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void note_error(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_last_error, sizeof g_last_error, fmt, ap);
    va_end(ap);
    fprintf(stderr, "stub-nvml: %s\n", g_last_error);
}

/* Reads and validates the file; returns the new scenario or NULL with g_last_error set. */
static stub_scenario *load_file(const char *path) {
    FILE *fh = fopen(path, "rb");
    if (!fh) {
        note_error("cannot open scenario %s: %s", path, strerror(errno));
        return NULL;
    }
    size_t cap = 65536, len = 0;
    char *buf = malloc(cap);
    while (buf) {
        if (len == cap) {
            if (cap >= (size_t)STUB_MAX_FILE_BYTES) {
                free(buf);
                fclose(fh);
                note_error("rejected scenario %s: larger than %ld bytes", path, STUB_MAX_FILE_BYTES);
                return NULL;
            }
            char *grown = realloc(buf, cap * 2);
            if (!grown) {
                free(buf);
                buf = NULL;
                break;
            }
            buf = grown;
            cap *= 2;
        }
        size_t got = fread(buf + len, 1, cap - len, fh);
        len += got;
        if (got == 0)
            break;
    }
    int read_error = ferror(fh);
    fclose(fh);
    if (!buf) {
        note_error("rejected scenario %s: out of memory", path);
        return NULL;
    }
    if (read_error) {
        free(buf);
        note_error("cannot read scenario %s", path);
        return NULL;
    }
    jnode root;
    char err[256];
    if (jparse_document(buf, len, &root, err, sizeof err)) {
        free(buf);
        note_error("rejected scenario %s: %s (keeping the previous one)", path, err);
        return NULL;
    }
    free(buf);
    vctx v = {{0}};
    stub_scenario *s = build_scenario(&root, &v);
    jfree(&root);
    if (!s)
        note_error("rejected scenario %s: %s (keeping the previous one)", path, v.err);
    return s;
}

/* One write is one change: (device, inode, size, mtime) all stay fixed once a writer's rename has
 * made the file visible. The ctime does not: rename(2) moves the renamed file's ctime after its new
 * name already resolves, so a stat racing the rename (the event thread wakes on the folder's
 * inotify events during every write) would see one write twice and load or reject it twice. The
 * writers move mtime forward on every write (stub_nvml.py's helpers, the sanitizer harness), which
 * is what makes mtime alone enough. */
static int same_stat(const struct stat *st) {
    return g_seen.valid && g_seen.dev == st->st_dev && g_seen.ino == st->st_ino && g_seen.size == st->st_size &&
           g_seen.mtim.tv_sec == st->st_mtim.tv_sec && g_seen.mtim.tv_nsec == st->st_mtim.tv_nsec;
}

static long long monotonic_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* Called with g_lock held: re-read the scenario when the file changed. Calls that start a read
 * (count, handles, driver version, event calls) always look (force); per-field calls look at most
 * once per STUB_FIELD_RECHECK_NS, so a collection costs a handful of stat()s, not one per field,
 * while "change the file, then collect" is always seen. */
static void refresh_locked(int force) {
    struct stat st;
    long long now = monotonic_ns();
    if (!force && now - g_last_check_ns < STUB_FIELD_RECHECK_NS)
        return;
    g_last_check_ns = now;
    if (!g_path[0] || stat(g_path, &st) != 0)
        return; /* a missing file keeps the last good scenario */
    if (same_stat(&st))
        return;
    g_seen.valid = 1;
    g_seen.dev = st.st_dev;
    g_seen.ino = st.st_ino;
    g_seen.size = st.st_size;
    g_seen.mtim = st.st_mtim;
    stub_scenario *fresh = load_file(g_path);
    if (!fresh) {
        g_rejects++;
        return;
    }
    free_scenario(g_scenario);
    g_scenario = fresh;
    g_loads++;
}

/* ---- entry helpers ----------------------------------------------------------------------------- */

static nvmlReturn_t enter_checked(int force) {
    pthread_mutex_lock(&g_lock);
    if (g_refcount == 0 || !g_scenario) {
        pthread_mutex_unlock(&g_lock);
        return NVML_ERROR_UNINITIALIZED;
    }
    refresh_locked(force);
    return NVML_SUCCESS;
}

static nvmlReturn_t enter(void) { return enter_checked(1); }

static void leave(void) { pthread_mutex_unlock(&g_lock); }

static int handle_index(nvmlDevice_t h, unsigned *index) {
    uintptr_t p = (uintptr_t)h, base = (uintptr_t)g_devices;
    if (p < base || p >= base + sizeof g_devices || (p - base) % sizeof g_devices[0])
        return 0;
    *index = (unsigned)((p - base) / sizeof g_devices[0]);
    return 1;
}

/* Locks, refreshes, resolves the handle; on success the caller must leave(). A lost GPU answers
 * GPU_IS_LOST to everything (as the driver does once it fell off the bus), before NOT_SUPPORTED. */
static nvmlReturn_t enter_device(nvmlDevice_t h, unsigned fn, const stub_gpu **out) {
    unsigned index;
    nvmlReturn_t rc = enter_checked(0);
    if (rc)
        return rc;
    if (!handle_index(h, &index)) {
        leave();
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    if (index >= g_scenario->n_gpus || g_scenario->gpus[index].lost) {
        leave();
        return NVML_ERROR_GPU_IS_LOST;
    }
    const stub_gpu *g = &g_scenario->gpus[index];
    if (g->not_supported & fn) {
        leave();
        return NVML_ERROR_NOT_SUPPORTED;
    }
    *out = g;
    return NVML_SUCCESS;
}

static nvmlReturn_t copy_string(char *dst, unsigned length, const char *src) {
    if (!dst)
        return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(src) + 1 > length)
        return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(dst, src, strlen(src) + 1);
    return NVML_SUCCESS;
}

/* A device getter that copies one scenario value: resolve the handle (lost, not supported), then
 * store EXPR (evaluated with `g` = the GPU) through the single output pointer. */
#define STUB_DEVICE_GETTER(NAME, TYPE, FN_BIT, EXPR)                                     \
    EXPORT nvmlReturn_t NAME(nvmlDevice_t device, TYPE *out) {                          \
        const stub_gpu *g;                                                              \
        if (!out)                                                                       \
            return NVML_ERROR_INVALID_ARGUMENT;                                         \
        nvmlReturn_t rc = enter_device(device, FN_BIT, &g);                             \
        if (rc)                                                                         \
            return rc;                                                                  \
        *out = (TYPE)(EXPR);                                                            \
        leave();                                                                        \
        return NVML_SUCCESS;                                                            \
    }

/* A device getter that copies one scenario string into the caller's sized buffer. */
#define STUB_DEVICE_STRING_GETTER(NAME, FIELD)                                           \
    EXPORT nvmlReturn_t NAME(nvmlDevice_t device, char *out, unsigned int length) {     \
        const stub_gpu *g;                                                              \
        nvmlReturn_t rc = enter_device(device, FN_NONE, &g);                            \
        if (rc)                                                                         \
            return rc;                                                                  \
        rc = copy_string(out, length, g->FIELD);                                        \
        leave();                                                                        \
        return rc;                                                                      \
    }

/* ---- library lifetime -------------------------------------------------------------------------- */

EXPORT nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    pthread_mutex_lock(&g_lock);
    if (g_refcount > 0) {
        g_refcount++;
        pthread_mutex_unlock(&g_lock);
        return NVML_SUCCESS;
    }
    const char *path = getenv("HEALTHAGENT_STUB_NVML_SCENARIO");
    if (!path || !path[0] || strlen(path) >= sizeof g_path) {
        fprintf(stderr, "stub-nvml: HEALTHAGENT_STUB_NVML_SCENARIO is not set; acting as a node without a driver\n");
        pthread_mutex_unlock(&g_lock);
        return NVML_ERROR_DRIVER_NOT_LOADED;
    }
    struct stat st;
    if (stat(path, &st) != 0) {
        note_error("scenario %s: %s; acting as a node without a driver", path, strerror(errno));
        pthread_mutex_unlock(&g_lock);
        return NVML_ERROR_DRIVER_NOT_LOADED;
    }
    snprintf(g_path, sizeof g_path, "%s", path);
    free_scenario(g_scenario);
    g_scenario = NULL;
    g_seen.valid = 0;
    refresh_locked(1);
    if (!g_scenario) {
        g_path[0] = '\0';
        pthread_mutex_unlock(&g_lock);
        return NVML_ERROR_UNKNOWN;
    }
    g_refcount = 1;
    pthread_mutex_unlock(&g_lock);
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
EXPORT nvmlReturn_t nvmlInit(void) { return nvmlInitWithFlags(0); }

EXPORT nvmlReturn_t nvmlShutdown(void) {
    pthread_mutex_lock(&g_lock);
    if (g_refcount == 0) {
        pthread_mutex_unlock(&g_lock);
        return NVML_ERROR_UNINITIALIZED;
    }
    if (--g_refcount == 0) { /* event sets die with the library's last user */
        for (int i = 0; i < STUB_MAX_EVENT_SETS; i++)
            release_set(&g_sets[i]);
        memset(g_sets, 0, sizeof g_sets);
    }
    pthread_mutex_unlock(&g_lock);
    return NVML_SUCCESS;
}

EXPORT const char *nvmlErrorString(nvmlReturn_t result) {
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
    case NVML_ERROR_ALREADY_INITIALIZED: return "Already Initialized";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_INSUFFICIENT_POWER: return "Insufficient External Power";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_IRQ_ISSUE: return "Interrupt request issue";
    case NVML_ERROR_LIBRARY_NOT_FOUND: return "NVML Shared Library Not Found";
    case NVML_ERROR_FUNCTION_NOT_FOUND: return "Function Not Found";
    case NVML_ERROR_CORRUPTED_INFOROM: return "Corrupted infoROM";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_RESET_REQUIRED: return "GPU requires restart";
    case NVML_ERROR_OPERATING_SYSTEM: return "The operating system has blocked the request.";
    case NVML_ERROR_LIB_RM_VERSION_MISMATCH: return "RM has detected an NVML/RM version mismatch.";
    case NVML_ERROR_IN_USE: return "In use by another client";
    case NVML_ERROR_MEMORY: return "Insufficient Memory";
    case NVML_ERROR_NO_DATA: return "No data";
    case NVML_ERROR_INSUFFICIENT_RESOURCES: return "Insufficient resources";
    default: return "Unknown Error";
    }
}

/* Test hook (not NVML): reload statistics and the last rejection reason. Also polls the file. */
EXPORT int stubNvmlStats(unsigned long long *loads, unsigned long long *rejects, char *last_error,
                         unsigned int length) {
    pthread_mutex_lock(&g_lock);
    if (g_refcount > 0)
        refresh_locked(1);
    if (loads)
        *loads = g_loads;
    if (rejects)
        *rejects = g_rejects;
    if (last_error && length)
        snprintf(last_error, length, "%s", g_last_error);
    pthread_mutex_unlock(&g_lock);
    return 0;
}

/* ---- system and inventory ---------------------------------------------------------------------- */

EXPORT nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    nvmlReturn_t rc = enter();
    if (rc)
        return rc;
    rc = copy_string(version, length, g_scenario->driver_version);
    leave();
    return rc;
}

EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    if (!count)
        return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t rc = enter();
    if (rc)
        return rc;
    *count = g_scenario->n_gpus;
    leave();
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetCount(unsigned int *count) { return nvmlDeviceGetCount_v2(count); }

EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    if (!device)
        return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t rc = enter();
    if (rc)
        return rc;
    if (index >= g_scenario->n_gpus) {
        rc = NVML_ERROR_INVALID_ARGUMENT;
    } else if (g_scenario->gpus[index].lost) {
        rc = NVML_ERROR_GPU_IS_LOST;
    } else {
        g_devices[index].index = index;
        *device = &g_devices[index];
    }
    leave();
    return rc;
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int index, nvmlDevice_t *device) {
    return nvmlDeviceGetHandleByIndex_v2(index, device);
}

STUB_DEVICE_GETTER(nvmlDeviceGetIndex, unsigned int, FN_NONE, g - g_scenario->gpus)

STUB_DEVICE_STRING_GETTER(nvmlDeviceGetUUID, uuid)
STUB_DEVICE_STRING_GETTER(nvmlDeviceGetName, name)

EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci) {
    const stub_gpu *g;
    if (!pci)
        return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t rc = enter_device(device, FN_NONE, &g);
    if (rc)
        return rc;
    memset(pci, 0, sizeof *pci);
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%s", g->bus_id_legacy);
    snprintf(pci->busId, sizeof pci->busId, "%s", g->bus_id);
    pci->domain = g->domain;
    pci->bus = g->bus;
    pci->device = g->device;
    pci->pciDeviceId = g->pci_device_id;
    pci->pciSubSystemId = g->pci_subsystem_id;
    leave();
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetPciInfo_v2(nvmlDevice_t device, nvmlPciInfo_t *pci) {
    return nvmlDeviceGetPciInfo_v3(device, pci);
}

EXPORT nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *current, unsigned int *pending) {
    const stub_gpu *g;
    if (!current || !pending)
        return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t rc = enter_device(device, FN_MIG_MODE, &g);
    if (rc)
        return rc;
    *current = *pending = g->mig_mode;
    leave();
    return NVML_SUCCESS;
}

/* ---- health counters --------------------------------------------------------------------------- */

EXPORT nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t device, int error_type, int counter_type,
                                                unsigned long long *count) {
    const stub_gpu *g;
    if (!count || error_type < 0 || error_type > 1 || counter_type < 0 || counter_type > 1)
        return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t rc = enter_device(device, FN_ECC, &g);
    if (rc)
        return rc;
    *count = g->ecc[error_type][counter_type];
    leave();
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t device, unsigned int *correctable,
                                              unsigned int *uncorrectable, unsigned int *pending,
                                              unsigned int *failure) {
    const stub_gpu *g;
    if (!correctable || !uncorrectable || !pending || !failure)
        return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t rc = enter_device(device, FN_REMAPPED_ROWS, &g);
    if (rc)
        return rc;
    *correctable = g->remap_correctable;
    *uncorrectable = g->remap_uncorrectable;
    *pending = g->remap_pending;
    *failure = g->remap_failure;
    leave();
    return NVML_SUCCESS;
}

static nvmlReturn_t retired_pages(nvmlDevice_t device, int cause, unsigned int *count,
                                  unsigned long long *addresses, unsigned long long *timestamps) {
    const stub_gpu *g;
    if (!count || cause < 0 || cause > 1)
        return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t rc = enter_device(device, FN_RETIRED_PAGES, &g);
    if (rc)
        return rc;
    unsigned have = g->retired[cause];
    if (*count < have) {
        *count = have;
        rc = NVML_ERROR_INSUFFICIENT_SIZE;
    } else if (have > 0 && !addresses) {
        rc = NVML_ERROR_INVALID_ARGUMENT;
    } else {
        for (unsigned i = 0; i < have; i++) {
            addresses[i] = (cause ? 0x2000000ULL : 0x1000000ULL) + (unsigned long long)i * 0x1000ULL;
            if (timestamps)
                timestamps[i] = 1700000000ULL + i;
        }
        *count = have;
    }
    leave();
    return rc;
}

EXPORT nvmlReturn_t nvmlDeviceGetRetiredPages(nvmlDevice_t device, int cause, unsigned int *count,
                                              unsigned long long *addresses) {
    return retired_pages(device, cause, count, addresses, NULL);
}

EXPORT nvmlReturn_t nvmlDeviceGetRetiredPages_v2(nvmlDevice_t device, int cause, unsigned int *count,
                                                 unsigned long long *addresses, unsigned long long *timestamps) {
    return retired_pages(device, cause, count, addresses, timestamps);
}

STUB_DEVICE_GETTER(nvmlDeviceGetRetiredPagesPendingStatus, int, FN_RETIRED_PAGES_PENDING, g->retired_pending)
STUB_DEVICE_GETTER(nvmlDeviceGetCurrentClocksEventReasons, unsigned long long, FN_CLOCKS_EVENT_REASONS,
                   g->clocks_event_reasons)

EXPORT nvmlReturn_t nvmlDeviceGetCurrentClocksThrottleReasons(nvmlDevice_t device, unsigned long long *reasons) {
    return nvmlDeviceGetCurrentClocksEventReasons(device, reasons);
}

/* enter_device for a per-link call: NOT_SUPPORTED without NVLink, INVALID_ARGUMENT past the last link. */
static nvmlReturn_t enter_link(nvmlDevice_t device, unsigned fn, unsigned link, const stub_gpu **out) {
    nvmlReturn_t rc = enter_device(device, fn, out);
    if (rc)
        return rc;
    if ((*out)->nvlink_links == 0)
        rc = NVML_ERROR_NOT_SUPPORTED;
    else if (link >= (*out)->nvlink_links)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    if (rc)
        leave();
    return rc;
}

EXPORT nvmlReturn_t nvmlDeviceGetNvLinkState(nvmlDevice_t device, unsigned int link, int *active) {
    const stub_gpu *g;
    if (!active)
        return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t rc = enter_link(device, FN_NVLINK_STATE, link, &g);
    if (rc)
        return rc;
    *active = (g->nvlink_inactive >> link) & 1ULL ? 0 : 1;
    leave();
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetNvLinkErrorCounter(nvmlDevice_t device, unsigned int link, int counter,
                                                    unsigned long long *value) {
    const stub_gpu *g;
    if (!value || counter < 0 || counter >= STUB_NVLINK_COUNTERS)
        return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t rc = enter_link(device, FN_NVLINK_ERRORS, link, &g);
    if (rc)
        return rc;
    *value = g->nvlink[counter][link];
    leave();
    return NVML_SUCCESS;
}

EXPORT nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device, int sensor, unsigned int *temperature) {
    const stub_gpu *g;
    if (!temperature || sensor != 0) /* NVML_TEMPERATURE_GPU */
        return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t rc = enter_device(device, FN_TEMPERATURE, &g);
    if (rc)
        return rc;
    *temperature = g->temperature_c;
    leave();
    return NVML_SUCCESS;
}

STUB_DEVICE_GETTER(nvmlDeviceGetPowerUsage, unsigned int, FN_POWER, g->power_mw)
STUB_DEVICE_GETTER(nvmlDeviceGetPcieReplayCounter, unsigned int, FN_PCIE_REPLAY, g->pcie_replay)

/* ---- events ------------------------------------------------------------------------------------ */

static struct stub_event_set *set_of(nvmlEventSet_t set) {
    uintptr_t p = (uintptr_t)set, base = (uintptr_t)g_sets;
    if (p < base || p >= base + sizeof g_sets || (p - base) % sizeof g_sets[0])
        return NULL;
    struct stub_event_set *s = (struct stub_event_set *)set;
    return s->in_use ? s : NULL;
}

static unsigned long long max_event_id(void) {
    return g_scenario->n_events ? g_scenario->events[g_scenario->n_events - 1].id : 0;
}

EXPORT nvmlReturn_t nvmlEventSetCreate(nvmlEventSet_t *set) {
    if (!set)
        return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t rc = enter();
    if (rc)
        return rc;
    rc = NVML_ERROR_INSUFFICIENT_RESOURCES;
    for (int i = 0; i < STUB_MAX_EVENT_SETS; i++) {
        if (!g_sets[i].in_use) {
            memset(&g_sets[i], 0, sizeof g_sets[i]);
            g_sets[i].in_use = 1;
            g_sets[i].watch = watch_scenario_folder(&g_sets[i]);
            g_sets[i].last_id = max_event_id(); /* a set hears only what happens after it exists */
            *set = &g_sets[i];
            rc = NVML_SUCCESS;
            break;
        }
    }
    leave();
    return rc;
}

STUB_DEVICE_GETTER(nvmlDeviceGetSupportedEventTypes, unsigned long long, FN_EVENTS, g->supported_events)

EXPORT nvmlReturn_t nvmlDeviceRegisterEvents(nvmlDevice_t device, unsigned long long types, nvmlEventSet_t set) {
    const stub_gpu *g;
    nvmlReturn_t rc = enter_device(device, FN_EVENTS, &g);
    if (rc)
        return rc;
    struct stub_event_set *s = set_of(set);
    unsigned index = (unsigned)(g - g_scenario->gpus);
    if (!s)
        rc = NVML_ERROR_INVALID_ARGUMENT;
    else if (types & ~g->supported_events)
        rc = NVML_ERROR_NOT_SUPPORTED;
    else {
        if (s->uuid_hash[index] != g->uuid_hash)
            s->mask[index] = 0;
        s->mask[index] |= types;
        s->uuid_hash[index] = g->uuid_hash;
    }
    leave();
    return rc;
}

/* A registered GPU that is lost, or no longer the GPU it was (count shrank, list re-ordered). */
static int set_has_lost_device(const struct stub_event_set *s) {
    for (unsigned i = 0; i < STUB_MAX_GPUS; i++) {
        if (!s->mask[i])
            continue;
        if (i >= g_scenario->n_gpus || g_scenario->gpus[i].lost || g_scenario->gpus[i].uuid_hash != s->uuid_hash[i])
            return 1;
    }
    return 0;
}

/* Delivers the next matching event above the set's watermark; 1 if one was delivered. */
static int next_event(struct stub_event_set *s, nvmlEventData_t *data) {
    const stub_scenario *sc = g_scenario;
    size_t lo = 0, hi = sc->n_events;
    while (lo < hi) { /* first event with id > last_id */
        size_t mid = lo + (hi - lo) / 2;
        if (sc->events[mid].id <= s->last_id)
            lo = mid + 1;
        else
            hi = mid;
    }
    for (size_t i = lo; i < sc->n_events; i++) {
        const stub_event *e = &sc->events[i];
        s->last_id = e->id;
        if (e->gpu >= sc->n_gpus || !(s->mask[e->gpu] & e->type) || sc->gpus[e->gpu].uuid_hash != s->uuid_hash[e->gpu])
            continue;
        data->device = &g_devices[e->gpu];
        data->eventType = e->type;
        data->eventData = e->data;
        data->gpuInstanceId = e->gpu_instance;
        data->computeInstanceId = e->compute_instance;
        return 1;
    }
    return 0;
}

/* Called with g_lock held: an inotify descriptor watching the folder that holds the scenario file,
 * for the event set `s` (-1: no file, or no inotify). Writers replace the file by rename, so the
 * folder is what to watch. One per event set, opened with it: closing an inotify descriptor waits
 * for the kernel's RCU grace period (milliseconds), far too slow to do per wait. For the same reason
 * a freed set's descriptor is kept and handed to the next set on the same folder: a caller that
 * creates and frees a set around every read would otherwise pay that wait every time. */
static int watch_scenario_folder(struct stub_event_set *s) {
    char folder[sizeof g_path];
    struct stat st;
    snprintf(folder, sizeof folder, "%s", g_path);
    if (!folder[0])
        return -1;
    const char *dir = dirname(folder);
    if (stat(dir, &st) != 0)
        return -1;
    s->watch_dev = st.st_dev;
    s->watch_ino = st.st_ino;
    for (int i = 0; i < g_spare_count; i++) {
        if (g_spare_watches[i].dev == st.st_dev && g_spare_watches[i].ino == st.st_ino) {
            int fd = g_spare_watches[i].fd;
            g_spare_watches[i] = g_spare_watches[--g_spare_count];
            char drain[4096]; /* changes from before this set existed are not its news */
            while (read(fd, drain, sizeof drain) > 0) {
            }
            return fd;
        }
    }
    int fd = inotify_init1(IN_NONBLOCK | IN_CLOEXEC);
    if (fd < 0)
        return -1;
    if (inotify_add_watch(fd, dir,
                          IN_MOVED_TO | IN_CLOSE_WRITE | IN_MODIFY | IN_CREATE | IN_ATTRIB | IN_DELETE) < 0) {
        close(fd);
        return -1;
    }
    return fd;
}

/* Called with g_lock held. The set's descriptor goes to the spares (closed only when they are full). */
static void release_set(struct stub_event_set *s) {
    if (s->in_use && s->watch >= 0) {
        if (g_spare_count < STUB_MAX_EVENT_SETS) {
            g_spare_watches[g_spare_count].fd = s->watch;
            g_spare_watches[g_spare_count].dev = s->watch_dev;
            g_spare_watches[g_spare_count].ino = s->watch_ino;
            g_spare_count++;
        } else {
            close(s->watch);
        }
    }
    s->in_use = 0;
    s->watch = -1;
}

/* Sleep until the scenario folder changes or left_ns passes; without a watch, a short nap. */
static void wait_for_change(int watch, long long left_ns) {
    if (watch < 0) {
        struct timespec nap = {0, left_ns < STUB_POLL_NS ? (long)left_ns : STUB_POLL_NS};
        nanosleep(&nap, NULL);
        return;
    }
    struct pollfd pfd = {watch, POLLIN, 0};
    long long ms = (left_ns + 999999LL) / 1000000LL;
    if (poll(&pfd, 1, ms > INT_MAX ? INT_MAX : (int)ms) > 0) {
        char drain[4096];
        while (read(watch, drain, sizeof drain) > 0) {
        }
    }
}

EXPORT nvmlReturn_t nvmlEventSetWait_v2(nvmlEventSet_t set, nvmlEventData_t *data, unsigned int timeoutms) {
    if (!data)
        return NVML_ERROR_INVALID_ARGUMENT;
    long long deadline = monotonic_ns() + (long long)timeoutms * 1000000LL;
    for (;;) {
        nvmlReturn_t rc = enter();
        if (rc)
            return rc;
        int watch = -1;
        struct stub_event_set *s = set_of(set);
        if (!s)
            rc = NVML_ERROR_INVALID_ARGUMENT;
        else if (next_event(s, data))
            rc = NVML_SUCCESS;
        else if (set_has_lost_device(s))
            rc = NVML_ERROR_GPU_IS_LOST;
        else
            rc = NVML_ERROR_TIMEOUT, watch = s->watch;
        leave();
        if (rc != NVML_ERROR_TIMEOUT)
            return rc;
        long long left = deadline - monotonic_ns();
        if (left <= 0)
            return NVML_ERROR_TIMEOUT;
        /* The watch was open before this look, so a change after the look still wakes the sleep. */
        wait_for_change(watch, left);
    }
}

EXPORT nvmlReturn_t nvmlEventSetFree(nvmlEventSet_t set) {
    pthread_mutex_lock(&g_lock); /* freeing after shutdown is harmless, so no init check here */
    struct stub_event_set *s = set_of(set);
    nvmlReturn_t rc = s ? NVML_SUCCESS : NVML_ERROR_INVALID_ARGUMENT;
    if (s)
        release_set(s);
    pthread_mutex_unlock(&g_lock);
    return rc;
}
