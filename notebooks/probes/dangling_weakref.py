"""Probe (session 41): what a weak reference left behind by an object freed without clearing
its weak references does to a process, reproduced on the CPU.

torch 2.11's CUDA stream and event objects are freed without clearing weak references to
them (pytorch PR #183403). gadgetloader's fork registry (``gadgetloader._fork._HOLDERS``, a
``WeakValueDictionary``) held the hybrid transfer's stream and events weakly. This probe
builds a tiny C type with the same defect (it takes weak references; its ``tp_dealloc``
frees the object without ``PyObject_ClearWeakRefs``), registers instances in the fork
registry the way the old code did (one per call, the previous one freed), and then:

* ``exit``: lets the interpreter exit normally. Under ``PYTHONMALLOC=debug`` (freed memory
  is overwritten with 0xdd) the process dies in ``_PyModule_Clear``, as the H200 test
  processes did, while the registry's weak references are torn down;
* ``fork``: forks, as a DataLoader with workers does: the registry's ``_before_fork`` reads
  every weak reference (``_HOLDERS.values()``) and so touches the freed memory.

Run: ``python notebooks/probes/dangling_weakref.py`` (needs a C compiler and Python's
headers). It prints the exit status of each case, run in a child interpreter with and
without ``PYTHONMALLOC=debug``, and of a control where the type clears its weak references.

Session 41 (CPU, Python 3.11.7, at gadgetloader ``9dda851``, i.e. the registration before
the fix): the ``fork`` case died of a segmentation fault (status -11, after its last line
ran) with and without the debug allocator; the ``exit`` case ended with status 0 (here each
freed instance's memory goes straight to the next instance, whose registration replaces
the dangling entry, so none is left at exit); the control ended with status 0 in every case.
"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import tempfile
import textwrap

C_SOURCE = r"""
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stddef.h>

typedef struct { PyObject_HEAD PyObject *weakreflist; } Obj;

static void obj_dealloc(Obj *self) {
#ifdef CLEARS
    if (self->weakreflist) PyObject_ClearWeakRefs((PyObject *)self);
#endif
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject ObjType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "badweak.Obj",
    .tp_basicsize = sizeof(Obj),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_dealloc = (destructor)obj_dealloc,
    .tp_weaklistoffset = offsetof(Obj, weakreflist),
};

static struct PyModuleDef mod = {PyModuleDef_HEAD_INIT, "badweak", NULL, -1, NULL};

PyMODINIT_FUNC PyInit_badweak(void) {
    if (PyType_Ready(&ObjType) < 0) return NULL;
    PyObject *m = PyModule_Create(&mod);
    if (!m) return NULL;
    Py_INCREF(&ObjType);
    PyModule_AddObject(m, "Obj", (PyObject *)&ObjType);
    return m;
}
"""

CHILD = textwrap.dedent(
    """
    import os, sys
    sys.path.insert(0, sys.argv[1])
    import badweak
    from gadgetloader import _fork
    for _ in range(50):  # the old hybrid transfer: a new event per call, the last one kept
        last = _fork.keep_in_forked_child(badweak.Obj())
    if sys.argv[2] == "fork":
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
    print("reached the end", flush=True)
    """
)


def build(where: str, clears: bool) -> None:
    src = os.path.join(where, "badweak.c")
    with open(src, "w") as f:
        f.write(C_SOURCE)
    out = os.path.join(where, "badweak" + sysconfig.get_config_var("EXT_SUFFIX"))
    inc = sysconfig.get_paths()["include"]
    cmd = ["cc", "-shared", "-fPIC", "-O1", f"-I{inc}", src, "-o", out]
    if clears:
        cmd.insert(1, "-DCLEARS")
    subprocess.run(cmd, check=True)


def main() -> None:
    for clears in (False, True):
        with tempfile.TemporaryDirectory() as d:
            build(d, clears)
            for case in ("exit", "fork"):
                for malloc in ("", "debug"):
                    env = dict(os.environ, PYTHONMALLOC=malloc) if malloc else dict(os.environ)
                    r = subprocess.run(
                        [sys.executable, "-c", CHILD, d, case],
                        env=env,
                        capture_output=True,
                        text=True,
                        timeout=120,
                    )
                    kind = "clears its weak refs" if clears else "leaves them dangling"
                    print(
                        f"type {kind:22s} case {case:4s} PYTHONMALLOC={malloc or 'default':7s}"
                        f" -> exit status {r.returncode}"
                        f" ({'reached the end' if 'reached the end' in r.stdout else 'died early'})"
                    )


if __name__ == "__main__":
    main()
