/* Every use of CPython's private or unstable C API by otelprof's C code, in one place.
 *
 * Like `otelprof/_otel_compat.py` and `otelprof/_torch_compat.py`: an upgrade of Python is a
 * review of this file. Each use says what it relies on and is guarded by version; where a
 * refinement is gone, the guard turns it off and the C code takes the general path (a dict
 * lookup, an attribute lookup) instead of failing. `_speedups.c` includes only this file,
 * uses only the stable or public API otherwise, and `tests/test_dependency_compat.py` fails
 * if a private name shows up there.
 *
 * Checked against CPython's headers for 3.10-3.14 (built and tested on 3.11 here).
 */
#ifndef OTELPROF_CPYTHON_COMPAT_H
#define OTELPROF_CPYTHON_COMPAT_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#if PY_VERSION_HEX < 0x030A0000
#error "otelprof's C hot path needs Python 3.10+ (Py_NewRef, vectorcall); pyproject says so too"
#endif

#define OTELPROF_CPYTHON_CHECKED "3.10-3.14"

/* ---- __slots__ fields read in place ----
 * A `__slots__` attribute is a member descriptor (PyMemberDescr_Type) whose PyMemberDef
 * gives the field's offset in the object. The descriptor's struct (PyMemberDescrObject,
 * cpython/descrobject.h) is not in the limited API; its member type was spelled T_OBJECT_EX
 * (structmember.h, deprecated in 3.12) before Py_T_OBJECT_EX (3.12). */
#if PY_VERSION_HEX < 0x030C0000
#include <structmember.h>
#endif
#ifndef Py_T_OBJECT_EX
#define Py_T_OBJECT_EX T_OBJECT_EX
#endif

/* The offset of `descr`'s field when it is a plain object slot of class `cls`, else -1. */
static inline Py_ssize_t
compat_object_slot_offset(PyObject *cls, PyObject *descr)
{
    if (!PyType_Check(cls) || !Py_IS_TYPE(descr, &PyMemberDescr_Type))
        return -1;
    PyMemberDef *member = ((PyMemberDescrObject *)descr)->d_member;
    return member->type == Py_T_OBJECT_EX ? member->offset : -1;
}

/* ---- dict version tags ----
 * A dict's `ma_version_tag` (a private field of PyDictObject) changes whenever the dict
 * does, so a module global looked up at a given version is still its value while the
 * version holds. Deprecated in 3.12 (the warning is silenced here), gone in 3.14: there
 * COMPAT_VERSION_TAGS is 0 and every read is a dict lookup. */
#if PY_VERSION_HEX < 0x030E0000
#define COMPAT_VERSION_TAGS 1
#else
#define COMPAT_VERSION_TAGS 0
#endif

static inline uint64_t
compat_dict_version(PyObject *dict)
{
#if COMPAT_VERSION_TAGS
#if defined(__GNUC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
#endif
    return ((PyDictObject *)dict)->ma_version_tag;
#if defined(__GNUC__)
#pragma GCC diagnostic pop
#endif
#else
    (void)dict;
    return 0;
#endif
}

/* ---- the calling thread ----
 * A thread state's id is unique for the interpreter's life (PyThreadState_GetID, public
 * since 3.9): the hot path keeps the last thread's state at hand by it. */
static inline uint64_t
compat_thread_id(void)
{
    return PyThreadState_GetID(PyThreadState_Get());
}

/* ---- reference helpers (non-limited macros; public since 3.10/3.12 respectively) ---- */
#ifndef Py_XSETREF
#define Py_XSETREF(dst, src)                                                                \
    do {                                                                                  \
        PyObject **_compat_dst = (PyObject **)&(dst);                                     \
        PyObject *_compat_old = *_compat_dst;                                             \
        *_compat_dst = (PyObject *)(src);                                                 \
        Py_XDECREF(_compat_old);                                                          \
    } while (0)
#endif

#endif /* OTELPROF_CPYTHON_COMPAT_H */
