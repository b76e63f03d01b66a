/* PyInit__fxio: the core's module (module.c), then the GPU pipeline's
 * types and functions (gpu.c), which drive the core's engines. Composed
 * here so that module.c does not call up into gpu.c. */
#include <Python.h>

#include "fxmodule.h"

PyMODINIT_FUNC PyInit__fxio(void)
{
    PyObject *m = fx_core_module_create();

    if (m && fx_gpu_module_init(m) < 0)
        Py_CLEAR(m);
    return m;
}
