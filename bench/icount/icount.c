/* A QEMU TCG plugin that counts guest instructions executed, for comparing ARM builds of the
 * same work under emulation (deterministic where wall time is not). Each translated block adds
 * its instruction count to one counter when it runs; the total is printed at exit as
 * "qwc-icount: N". Single-threaded guests only (the inline add is not atomic). */
#include <inttypes.h>
#include <stdio.h>
#include <qemu-plugin.h>

QEMU_PLUGIN_EXPORT int qemu_plugin_version = QEMU_PLUGIN_VERSION;

static uint64_t executed;

static void on_translate(qemu_plugin_id_t id, struct qemu_plugin_tb *tb)
{
    qemu_plugin_register_vcpu_tb_exec_inline(tb, QEMU_PLUGIN_INLINE_ADD_U64, &executed,
                                             qemu_plugin_tb_n_insns(tb));
}

static void on_exit(qemu_plugin_id_t id, void *data)
{
    fprintf(stderr, "qwc-icount: %" PRIu64 "\n", executed);
}

QEMU_PLUGIN_EXPORT int qemu_plugin_install(qemu_plugin_id_t id, const qemu_info_t *info,
                                           int argc, char **argv)
{
    qemu_plugin_register_vcpu_tb_trans_cb(id, on_translate);
    qemu_plugin_register_atexit_cb(id, on_exit, NULL);
    return 0;
}
