/* GPU staging and DMA without GDS: to be filled in (issue 6). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "fxmodule.h"

int fx_gpu_module_init(PyObject *module, PyTypeObject *engine_type)
{
    (void)module;
    (void)engine_type;
    return 0;
}
