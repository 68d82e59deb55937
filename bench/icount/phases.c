/* A QEMU TCG plugin that counts guest instructions per guest thread and per synchronisation
 * epoch, for the many-thread critical path (bench/arm_threads.py). qemu-user runs each guest
 * thread as its own vCPU, so a count per vCPU is a count per thread.
 *
 *   -plugin libqwc_phases.so,out=FILE,mark=KIND:FILE_NAME:OFFSET[-END][,mark=...]
 *
 * A mark is a block of code that starts at OFFSET (or in [OFFSET, END)) of the mapped file
 * FILE_NAME (a basename), found by the host address QEMU translated it from. KIND:
 *   launch   a fork: a new global epoch begins (every thread's counts go to it) and this
 *            thread enters its "launch" phase (TVMBackendParallelLaunch's entry);
 *   return   this thread leaves its launch phase (code a launch returns to: the kernels that
 *            call TVMBackendParallelLaunch, whose parallel bodies are elsewhere);
 *   barrier  this thread's own epoch advances (a barrier every thread passes, in the same
 *            order: OpenMP's GOMP_barrier in llama.cpp).
 * With any launch mark the epochs are global; otherwise each thread counts its own.
 *
 * At exit FILE gets one binary record per (thread, epoch, phase, block start):
 *   uint32 vcpu, uint32 epoch, uint32 phase, uint32 pad, uint64 guest address, uint64 instructions
 * and the plugin prints "qwc-icount: TOTAL". Each thread updates only its own table; the
 * callbacks run on the thread's own vCPU, so no count is shared between threads. */
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <qemu-plugin.h>

QEMU_PLUGIN_EXPORT int qemu_plugin_version = QEMU_PLUGIN_VERSION;

enum { MARK_NONE, MARK_LAUNCH, MARK_RETURN, MARK_BARRIER };
#define MAX_MARKS 4096
#define MAX_VCPUS 4096

typedef struct { int kind; char file[256]; uint64_t lo, hi; } Mark;
typedef struct { uint64_t vaddr; uint32_t insns; int mark; } Block;
typedef struct { const Block *block; uint32_t epoch, phase; uint64_t count; } Entry;
typedef struct { uint32_t epoch, phase; Entry *tab; size_t cap, used; } Vcpu;
typedef struct { uint64_t lo, hi, offset; char file[256]; } Map;

static Mark marks[MAX_MARKS];
static int n_marks, global_epochs;
static Vcpu vcpus[MAX_VCPUS];
static _Atomic uint32_t global_epoch;
static char out_path[4096];
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;   /* translation and the maps cache */
static Map *maps;
static size_t n_maps;

/* -- where a host address comes from: this process's own mappings ------------------------- */

static void read_maps(void)
{
    FILE *f = fopen("/proc/self/maps", "r");
    char line[4608];
    size_t cap = n_maps = 0;
    free(maps);
    maps = NULL;
    if (!f)
        return;
    while (fgets(line, sizeof line, f)) {
        uint64_t lo, hi, off;
        char perms[8], dev[16], path[4096] = "";
        unsigned long inode;
        if (sscanf(line, "%" SCNx64 "-%" SCNx64 " %7s %" SCNx64 " %15s %lu %4095s", &lo, &hi, perms, &off,
                   dev, &inode, path) < 6 || !path[0])
            continue;
        if (n_maps == cap)
            maps = realloc(maps, (cap = cap ? 2 * cap : 256) * sizeof *maps);
        const char *base = strrchr(path, '/');
        maps[n_maps] = (Map){lo, hi, off, ""};
        snprintf(maps[n_maps].file, sizeof maps[n_maps].file, "%s", base ? base + 1 : path);
        n_maps++;
    }
    fclose(f);
}

static const Map *find_map(uint64_t haddr)
{
    for (size_t i = 0; i < n_maps; i++)
        if (maps[i].lo <= haddr && haddr < maps[i].hi)
            return &maps[i];
    return NULL;
}

static int mark_of(uint64_t haddr)
{
    if (!n_marks || !haddr)
        return MARK_NONE;
    const Map *m = find_map(haddr);
    if (!m) {   /* mapped since the last read */
        read_maps();
        m = find_map(haddr);
    }
    if (!m)
        return MARK_NONE;
    uint64_t off = haddr - m->lo + m->offset;
    for (int i = 0; i < n_marks; i++)
        if (marks[i].lo <= off && off < marks[i].hi && !strcmp(marks[i].file, m->file))
            return marks[i].kind;
    return MARK_NONE;
}

/* -- counting ---------------------------------------------------------------------------------- */

static uint64_t hash(const Block *b, uint32_t epoch, uint32_t phase)
{
    uint64_t h = (uint64_t)(uintptr_t)b * 0x9E3779B97F4A7C15ull ^ ((uint64_t)epoch << 1 | phase) * 0xC2B2AE3D27D4EB4Full;
    return h ^ h >> 29;
}

static void add(Vcpu *v, const Block *b, uint64_t n)
{
    if (2 * (v->used + 1) > v->cap) {   /* grow at half full */
        size_t cap = v->cap ? 2 * v->cap : 1 << 12;
        Entry *tab = calloc(cap, sizeof *tab);
        for (size_t i = 0; i < v->cap; i++) {
            Entry *e = &v->tab[i];
            if (!e->block)
                continue;
            size_t j = hash(e->block, e->epoch, e->phase) & (cap - 1);
            while (tab[j].block)
                j = (j + 1) & (cap - 1);
            tab[j] = *e;
        }
        free(v->tab);
        v->tab = tab;
        v->cap = cap;
    }
    size_t j = hash(b, v->epoch, v->phase) & (v->cap - 1);
    for (;; j = (j + 1) & (v->cap - 1)) {
        Entry *e = &v->tab[j];
        if (!e->block) {
            *e = (Entry){b, v->epoch, v->phase, n};
            v->used++;
            return;
        }
        if (e->block == b && e->epoch == v->epoch && e->phase == v->phase) {
            e->count += n;
            return;
        }
    }
}

static void on_exec(unsigned int vcpu, void *udata)
{
    const Block *b = udata;
    if (vcpu >= MAX_VCPUS)
        return;
    Vcpu *v = &vcpus[vcpu];
    switch (b->mark) {
    case MARK_LAUNCH:
        atomic_fetch_add(&global_epoch, 1);
        v->phase = 1;
        break;
    case MARK_RETURN:
        v->phase = 0;
        break;
    case MARK_BARRIER:
        v->epoch++;
        break;
    }
    if (global_epochs)
        v->epoch = atomic_load_explicit(&global_epoch, memory_order_relaxed);
    add(v, b, b->insns);
}

static void on_translate(qemu_plugin_id_t id, struct qemu_plugin_tb *tb)
{
    Block *b = calloc(1, sizeof *b);
    b->vaddr = qemu_plugin_tb_vaddr(tb);
    b->insns = qemu_plugin_tb_n_insns(tb);
    pthread_mutex_lock(&lock);
    b->mark = mark_of((uint64_t)(uintptr_t)qemu_plugin_insn_haddr(qemu_plugin_tb_get_insn(tb, 0)));
    pthread_mutex_unlock(&lock);
    qemu_plugin_register_vcpu_tb_exec_cb(tb, on_exec, QEMU_PLUGIN_CB_NO_REGS, b);
}

static void at_exit(qemu_plugin_id_t id, void *data)
{
    FILE *f = out_path[0] ? fopen(out_path, "wb") : NULL;
    uint64_t total = 0;
    if (out_path[0] && !f)
        fprintf(stderr, "qwc-icount: cannot write %s\n", out_path);
    for (unsigned int c = 0; c < MAX_VCPUS; c++) {
        Vcpu *v = &vcpus[c];
        for (size_t i = 0; i < v->cap; i++) {
            Entry *e = &v->tab[i];
            if (!e->block)
                continue;
            total += e->count;
            if (f) {
                struct { uint32_t vcpu, epoch, phase, pad; uint64_t vaddr, count; } r =
                    {c, e->epoch, e->phase, 0, e->block->vaddr, e->count};
                fwrite(&r, sizeof r, 1, f);
            }
        }
    }
    if (f)
        fclose(f);
    fprintf(stderr, "qwc-icount: %" PRIu64 "\n", total);
}

static int parse_mark(const char *spec)
{
    static const char *kinds[] = {"", "launch", "return", "barrier"};
    char kind[16];
    Mark *m = &marks[n_marks];
    int n = n_marks == MAX_MARKS ? 0 : sscanf(spec, "%15[^:]:%255[^:]:%" SCNi64 "-%" SCNi64, kind, m->file, &m->lo, &m->hi);
    if (n < 3)
        return -1;
    if (n == 3)
        m->hi = m->lo + 1;
    for (int k = 1; k < 4; k++)
        if (!strcmp(kind, kinds[k]))
            m->kind = k;
    if (!m->kind)
        return -1;
    global_epochs |= m->kind == MARK_LAUNCH;
    n_marks++;
    return 0;
}

QEMU_PLUGIN_EXPORT int qemu_plugin_install(qemu_plugin_id_t id, const qemu_info_t *info,
                                           int argc, char **argv)
{
    for (int i = 0; i < argc; i++) {
        if (!strncmp(argv[i], "out=", 4)) {
            snprintf(out_path, sizeof out_path, "%s", argv[i] + 4);
        } else if (!strncmp(argv[i], "mark=", 5)) {
            if (parse_mark(argv[i] + 5)) {
                fprintf(stderr, "qwc-icount: bad mark %s (launch|return|barrier:FILE:OFFSET[-END])\n", argv[i] + 5);
                return -1;
            }
        } else {
            fprintf(stderr, "qwc-icount: unknown argument %s (takes out=FILE, mark=...)\n", argv[i]);
            return -1;
        }
    }
    read_maps();
    qemu_plugin_register_vcpu_tb_trans_cb(id, on_translate);
    qemu_plugin_register_atexit_cb(id, at_exit, NULL);
    return 0;
}
