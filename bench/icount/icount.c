/* A QEMU TCG plugin that counts guest instructions executed, for comparing ARM builds of the
 * same work under emulation (deterministic where wall time is not). Each translated block
 * bumps its own execution counter when it runs; at exit the plugin prints the total as
 * "qwc-icount: N" and, given out=FILE, writes "start_address instructions" for every block
 * start that ran, which bench/arm_icount.py attributes to functions. Single-threaded
 * guests only (the inline add is not atomic). */
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <qemu-plugin.h>

QEMU_PLUGIN_EXPORT int qemu_plugin_version = QEMU_PLUGIN_VERSION;

typedef struct Block {
    uint64_t vaddr, insns, runs;
    struct Block *next;
} Block;

static Block *blocks;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static char out_path[4096];

static void on_translate(qemu_plugin_id_t id, struct qemu_plugin_tb *tb)
{
    Block *b = calloc(1, sizeof *b);
    b->vaddr = qemu_plugin_tb_vaddr(tb);
    b->insns = qemu_plugin_tb_n_insns(tb);
    pthread_mutex_lock(&lock);   /* translation may run on several vCPU threads */
    b->next = blocks;
    blocks = b;
    pthread_mutex_unlock(&lock);
    qemu_plugin_register_vcpu_tb_exec_inline(tb, QEMU_PLUGIN_INLINE_ADD_U64, &b->runs, 1);
}

static void at_exit(qemu_plugin_id_t id, void *data)
{
    uint64_t total = 0;
    for (Block *b = blocks; b; b = b->next)
        total += b->runs * b->insns;
    fprintf(stderr, "qwc-icount: %" PRIu64 "\n", total);
    if (!out_path[0])
        return;
    FILE *f = fopen(out_path, "w");
    if (!f) {
        fprintf(stderr, "qwc-icount: cannot write %s\n", out_path);
        return;
    }
    /* a block retranslated after a flush appears twice: the reader adds them up */
    for (Block *b = blocks; b; b = b->next)
        if (b->runs)
            fprintf(f, "%" PRIx64 " %" PRIu64 "\n", b->vaddr, b->runs * b->insns);
    fclose(f);
}

QEMU_PLUGIN_EXPORT int qemu_plugin_install(qemu_plugin_id_t id, const qemu_info_t *info,
                                           int argc, char **argv)
{
    for (int i = 0; i < argc; i++) {
        if (!strncmp(argv[i], "out=", 4)) {
            snprintf(out_path, sizeof out_path, "%s", argv[i] + 4);
        } else {
            fprintf(stderr, "qwc-icount: unknown argument %s (takes out=FILE)\n", argv[i]);
            return -1;
        }
    }
    qemu_plugin_register_vcpu_tb_trans_cb(id, on_translate);
    qemu_plugin_register_atexit_cb(id, at_exit, NULL);
    return 0;
}
