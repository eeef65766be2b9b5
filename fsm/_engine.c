/* terminus.fsm._engine: the engine's hot paths, compiled.
 *
 * The reference implementation is the Python in fsm/ledger.py and fsm/machine.py;
 * this module is its common case in C, with exactly the same decisions, and hands
 * everything else back to that Python (a call to the `*_py` method of the same name,
 * or to the machine's general path). Without it (no compiler at install time, or
 * TERMINUS_PURE_PYTHON=1) the package runs the Python alone.
 *
 *   Holder        the slots of an instance (_m, _s, _q, _owns, key), its __init__,
 *                 and `fire` (the table lookup and store of a plain transition)
 *   MachineCore   the slots of a machine that `fire` reads (_rows, _on, terminal,
 *                 ledger, initial)
 *   LedgerCore    the slots of a ledger, and `acquire` / `transfer` / `owned` for
 *                 the engine's instances
 *   PlanCell      a terminal edge's compiled step: the state stored, the plan's steps
 *                 run in order in a live release context, the report returned
 *
 * Slots are member descriptors (T_OBJECT_EX), as Python's __slots__ are, so the
 * interpreter's specialised attribute loads and stores work on them unchanged.
 * Handle, PlanReport and ReleaseContext stay the Python classes they are; their
 * fields are read and written here at the offsets of their member descriptors,
 * found once by `setup()`.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#define ENGINE_API 3

/* -- what setup() gives ------------------------------------------------------------ */

static int configured = 0;
static PyTypeObject *HandleType = NULL;
static PyTypeObject *ReportType = NULL;
static PyTypeObject *ContextType = NULL;
static PyTypeObject *QueuedType = NULL;   /* ledger.QueuedInPlan */
static PyObject *PLAN_RUNNING = NULL;     /* ledger.PLAN_RUNNING: _q of a running plan */
static PyObject *step_failed = NULL;      /* fn(report, (name, best_effort), exc) */
static PyObject *step_returned = NULL;    /* fn(ledger, res, report, (name, best_effort)) */
static PyObject *SWEPT = NULL;            /* (None, False): about of the sweep */
static Py_ssize_t SWEEPS = 16;            /* ledger._SWEEPS */
static Py_ssize_t COMPACT_MIN = 4096;     /* ledger._COMPACT_MIN */
static PyObject *ONE = NULL;

static Py_ssize_t H_KIND, H_VALUE, H_OWNER, H_RELEASED;
static Py_ssize_t R_RELEASED, R_ERRORS;
static Py_ssize_t C_EDGE, C_LIVE, C_EVENT, C_INSTANCE, C_RESOURCES, C_TARGET, C_LEDGER;

static PyObject *s_fire_py, *s_fire_slow, *s_acquire_py, *s_transfer_py, *s_owned_py;
static PyObject *s_compact_py, *s_planning, *s_release_late, *s_sweep_failed, *s_plan_failed;
static PyObject *s_drain_after_plan, *s_initial;

#define SLOT(o, off) (*(PyObject **)((char *)(o) + (off)))

static inline void
slot_set(PyObject *o, Py_ssize_t off, PyObject *v)
{
    PyObject *old = SLOT(o, off);
    Py_XINCREF(v);
    SLOT(o, off) = v;
    Py_XDECREF(old);
}

/* A store into a msgspec Struct's field: as its setattr does, a struct that was left
 * untracked (no field could make a cycle) is tracked once a field may. */
static inline void
struct_set(PyObject *o, Py_ssize_t off, PyObject *v)
{
    slot_set(o, off, v);
    if (PyObject_IS_GC(v) && !PyObject_GC_IsTracked(o) && PyObject_IS_GC(o)
            && (!PyTuple_CheckExact(v) || PyObject_GC_IsTracked(v)))
        PyObject_GC_Track(o);
}

/* The raised exception, normalized and with its traceback, cleared (3.10/3.11 have no
 * PyErr_GetRaisedException). */
static PyObject *
fetch_exception(void)
{
    PyObject *t, *v, *tb;
    PyErr_Fetch(&t, &v, &tb);
    PyErr_NormalizeException(&t, &v, &tb);
    if (tb != NULL) {
        PyException_SetTraceback(v, tb);
        Py_DECREF(tb);
    }
    Py_XDECREF(t);
    return v;
}

static int
require_configured(void)
{
    if (!configured) {
        PyErr_SetString(PyExc_RuntimeError,
                        "terminus.fsm._engine is not set up (terminus.fsm.ledger calls setup())");
        return -1;
    }
    return 0;
}

/* Call obj.name(*args) with vectorcall. */
static PyObject *
call_method(PyObject *obj, PyObject *name, PyObject *const *args, Py_ssize_t n)
{
    PyObject *stack[8];
    stack[0] = obj;
    for (Py_ssize_t i = 0; i < n; i++)
        stack[i + 1] = args[i];
    return PyObject_VectorcallMethod(name, stack, (size_t)(n + 1) | PY_VECTORCALL_ARGUMENTS_OFFSET,
                                     NULL);
}

/* -- Holder ------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    PyObject *m;     /* _m: the machine */
    PyObject *s;     /* _s: the state id (an int) */
    PyObject *q;     /* _q: None, or what is queued while the engine runs a step */
    PyObject *owns;  /* _owns: None, one Handle, or a list of them */
    PyObject *key;
} HolderObject;

static PyTypeObject HolderType;
static PyTypeObject MachineCoreType;

typedef struct {
    PyObject_HEAD
    PyObject *rows;      /* _rows: per state, {event class: code} */
    PyObject *on;        /* _on: what fire calls for a code < 0 */
    PyObject *terminal;  /* terminal: tuple of bools by state */
    PyObject *ledger;
    PyObject *initial;
} MachineCoreObject;

/* `isinstance(o, base)` for a C base with slots of its own: a subclass's layout extends
 * its base's, so the chain of `tp_base` reaches it within a few steps (a test of a few
 * pointers, where PyObject_TypeCheck walks the MRO in a call). */
static inline int
extends(PyObject *o, PyTypeObject *base)
{
    PyTypeObject *t = Py_TYPE(o);
    for (int i = 0; i < 6 && t != NULL; i++, t = t->tp_base)
        if (t == base)
            return 1;
    return t != NULL && PyType_IsSubtype(t, base);
}

#define Holder_Check(o) extends((o), &HolderType)
#define MachineCore_Check(o) extends((o), &MachineCoreType)

static PyObject *
Holder_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    HolderObject *self = (HolderObject *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    Py_INCREF(Py_None);
    self->q = Py_None;
    Py_INCREF(Py_None);
    self->owns = Py_None;
    Py_INCREF(Py_None);
    self->key = Py_None;
    return (PyObject *)self;
}

static int
Holder_init(HolderObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"machine", "key", NULL};
    PyObject *machine, *key = Py_None, *initial;
    Py_ssize_t nargs = PyTuple_GET_SIZE(args);
    if ((kwds == NULL || !PyDict_GET_SIZE(kwds)) && (nargs == 1 || nargs == 2)) {
        machine = PyTuple_GET_ITEM(args, 0);  /* (machine) or (machine, key): the calls made */
        if (nargs == 2)
            key = PyTuple_GET_ITEM(args, 1);
    } else if (!PyArg_ParseTupleAndKeywords(args, kwds, "O|O:Instance", kwlist, &machine,
                                            &key)) {
        return -1;
    }
    if (MachineCore_Check(machine) && ((MachineCoreObject *)machine)->initial != NULL) {
        initial = ((MachineCoreObject *)machine)->initial;
        Py_INCREF(initial);
    } else {
        initial = PyObject_GetAttr(machine, s_initial);
        if (initial == NULL)
            return -1;
    }
    Py_INCREF(machine);
    Py_XSETREF(self->m, machine);
    Py_XSETREF(self->s, initial);
    Py_INCREF(Py_None);
    Py_XSETREF(self->q, Py_None);
    Py_INCREF(Py_None);
    Py_XSETREF(self->owns, Py_None);
    Py_INCREF(key);
    Py_XSETREF(self->key, key);
    return 0;
}

static int
Holder_traverse(HolderObject *self, visitproc visit, void *arg)
{
    Py_VISIT(self->m);
    Py_VISIT(self->s);
    Py_VISIT(self->q);
    Py_VISIT(self->owns);
    Py_VISIT(self->key);
    return 0;
}

static int
Holder_clear(HolderObject *self)
{
    Py_CLEAR(self->m);
    Py_CLEAR(self->s);
    Py_CLEAR(self->q);
    Py_CLEAR(self->owns);
    Py_CLEAR(self->key);
    return 0;
}

static void
Holder_dealloc(HolderObject *self)
{
    PyObject_GC_UnTrack(self);
    Holder_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Instance.fire(event): see fsm/machine.py (`Instance._fire_py` is the same in Python). */
static PyObject *
Holder_fire(HolderObject *self, PyObject *event)
{
    PyObject *m = self->m;
    if (m == NULL || !MachineCore_Check(m) || self->s == NULL)
        return call_method((PyObject *)self, s_fire_py, &event, 1);
    if (self->q != Py_None) {
        PyObject *args[2] = {(PyObject *)self, event};
        return call_method(m, s_fire_slow, args, 2);
    }
    MachineCoreObject *mc = (MachineCoreObject *)m;
    PyObject *rows = mc->rows;
    if (rows == NULL || !PyTuple_CheckExact(rows))
        return call_method((PyObject *)self, s_fire_py, &event, 1);
    Py_ssize_t s = PyLong_AsSsize_t(self->s);
    if (s == -1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(rows);
    if (s < 0)
        s += n;
    if (s < 0 || s >= n) {
        PyErr_SetString(PyExc_IndexError, "tuple index out of range");
        return NULL;
    }
    PyObject *row = PyTuple_GET_ITEM(rows, s);
    PyObject *code;
    if (PyDict_CheckExact(row)) {
        code = PyDict_GetItemWithError(row, (PyObject *)Py_TYPE(event));  /* borrowed */
        if (code == NULL) {
            if (PyErr_Occurred())
                return NULL;
            PyObject *args[2] = {(PyObject *)self, event};
            return call_method(m, s_fire_slow, args, 2);
        }
    } else {
        return call_method((PyObject *)self, s_fire_py, &event, 1);
    }
    Py_ssize_t c = PyLong_AsSsize_t(code);
    if (c == -1 && PyErr_Occurred())
        return NULL;
    if (c >= 0) {
        Py_INCREF(code);
        Py_SETREF(self->s, code);
        Py_RETURN_NONE;
    }
    /* The cell's entry, indexed from the end of the table in use. */
    PyObject *on = mc->on;
    PyObject *f;
    if (on != NULL && PyList_CheckExact(on)) {
        Py_ssize_t k = PyList_GET_SIZE(on) + c;
        if (k < 0) {
            PyErr_SetString(PyExc_IndexError, "list index out of range");
            return NULL;
        }
        f = PyList_GET_ITEM(on, k);
    } else if (on != NULL && PyTuple_CheckExact(on)) {
        Py_ssize_t k = PyTuple_GET_SIZE(on) + c;
        if (k < 0) {
            PyErr_SetString(PyExc_IndexError, "tuple index out of range");
            return NULL;
        }
        f = PyTuple_GET_ITEM(on, k);
    } else {
        return call_method((PyObject *)self, s_fire_py, &event, 1);
    }
    Py_INCREF(f);
    PyObject *args[2] = {(PyObject *)self, event};
    PyObject *res = PyObject_Vectorcall(f, args, 2, NULL);
    Py_DECREF(f);
    return res;
}

static PyMethodDef Holder_methods[] = {
    {"fire", (PyCFunction)Holder_fire, METH_O,
     "Deliver `event`. Returns the PlanReport when it ran a release plan, else None.\n\n"
     "Raises TransitionNotAllowed where the declaration makes the event an error,\n"
     "UnknownEvent for an object that is not one of the machine's events, and\n"
     "ReleaseFailed when a non-best-effort release step raised (after every step ran)."},
    {NULL}
};

static PyMemberDef Holder_members[] = {
    {"_m", T_OBJECT_EX, offsetof(HolderObject, m), 0, NULL},
    {"_s", T_OBJECT_EX, offsetof(HolderObject, s), 0, NULL},
    {"_q", T_OBJECT_EX, offsetof(HolderObject, q), 0, NULL},
    {"_owns", T_OBJECT_EX, offsetof(HolderObject, owns), 0, NULL},
    {"key", T_OBJECT_EX, offsetof(HolderObject, key), 0, NULL},
    {NULL}
};

static PyTypeObject HolderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "terminus.fsm._engine.Holder",
    .tp_doc = "The slots of the engine's instances: a machine `_m`, a state id `_s`, `_q` "
              "(None, or the events queued while the engine runs a step of it), `_owns` "
              "(what the ledger records it owns) and `key`.",
    .tp_basicsize = sizeof(HolderObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_new = Holder_new,
    .tp_init = (initproc)Holder_init,
    .tp_dealloc = (destructor)Holder_dealloc,
    .tp_traverse = (traverseproc)Holder_traverse,
    .tp_clear = (inquiry)Holder_clear,
    .tp_methods = Holder_methods,
    .tp_members = Holder_members,
};

/* -- MachineCore -------------------------------------------------------------------- */

static int
MachineCore_traverse(MachineCoreObject *self, visitproc visit, void *arg)
{
    Py_VISIT(self->rows);
    Py_VISIT(self->on);
    Py_VISIT(self->terminal);
    Py_VISIT(self->ledger);
    Py_VISIT(self->initial);
    return 0;
}

static int
MachineCore_clear(MachineCoreObject *self)
{
    Py_CLEAR(self->rows);
    Py_CLEAR(self->on);
    Py_CLEAR(self->terminal);
    Py_CLEAR(self->ledger);
    Py_CLEAR(self->initial);
    return 0;
}

static void
MachineCore_dealloc(MachineCoreObject *self)
{
    PyObject_GC_UnTrack(self);
    MachineCore_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMemberDef MachineCore_members[] = {
    {"_rows", T_OBJECT_EX, offsetof(MachineCoreObject, rows), 0, NULL},
    {"_on", T_OBJECT_EX, offsetof(MachineCoreObject, on), 0, NULL},
    {"terminal", T_OBJECT_EX, offsetof(MachineCoreObject, terminal), 0,
     "Per state id, whether the state is terminal."},
    {"ledger", T_OBJECT_EX, offsetof(MachineCoreObject, ledger), 0,
     "The ledger the machine's release plans run over (None: unbound, or bound without one)."},
    {"initial", T_OBJECT_EX, offsetof(MachineCoreObject, initial), 0,
     "The initial state's id."},
    {NULL}
};

static PyTypeObject MachineCoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "terminus.fsm._engine.MachineCore",
    .tp_doc = "The slots of a machine that Instance.fire reads.",
    .tp_basicsize = sizeof(MachineCoreObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_dealloc = (destructor)MachineCore_dealloc,
    .tp_traverse = (traverseproc)MachineCore_traverse,
    .tp_clear = (inquiry)MachineCore_clear,
    .tp_members = MachineCore_members,
};

/* Whether the instance's state is terminal: its machine's `terminal[_s]`; -1 on error
 * (only for a holder whose machine is a MachineCore, as every caller checked). */
static int
holder_terminal(HolderObject *h)
{
    PyObject *term = ((MachineCoreObject *)h->m)->terminal;
    if (term == NULL || h->s == NULL) {
        PyErr_SetString(PyExc_AttributeError, "terminal");
        return -1;
    }
    PyObject *t;
    if (PyTuple_CheckExact(term)) {
        Py_ssize_t s = PyLong_AsSsize_t(h->s);
        if (s == -1 && PyErr_Occurred())
            return -1;
        Py_ssize_t n = PyTuple_GET_SIZE(term);
        if (s < 0)
            s += n;
        if (s < 0 || s >= n) {
            PyErr_SetString(PyExc_IndexError, "tuple index out of range");
            return -1;
        }
        t = PyTuple_GET_ITEM(term, s);
        if (t == Py_True)
            return 1;
        if (t == Py_False)
            return 0;
        return PyObject_IsTrue(t);
    }
    t = PyObject_GetItem(term, h->s);
    if (t == NULL)
        return -1;
    int r = PyObject_IsTrue(t);
    Py_DECREF(t);
    return r;
}

/* -- LedgerCore --------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    PyObject *resources;
    PyObject *releasers;   /* _releasers: kind -> the @release_effect default releaser */
    PyObject *raw;         /* _raw: kind -> the function it wraps */
    PyObject *owned;       /* _owned: owners that are not Holders -> what they own */
    PyObject *all;         /* _all: handles since the last compaction */
    Py_ssize_t compact_at; /* _compact_at */
    PyObject *observers;   /* _observers: Handle -> observers */
    PyObject *tasks;       /* _tasks */
    PyObject *plan_owner;  /* _plan_owner */
    PyObject *in_plan;     /* _in_plan */
    PyObject *errors;
    Py_ssize_t released;   /* _released */
    PyObject *flushes;     /* _flushes */
    Py_ssize_t late_released;
} LedgerCoreObject;

static PyTypeObject LedgerCoreType;

static int
LedgerCore_traverse(LedgerCoreObject *self, visitproc visit, void *arg)
{
    Py_VISIT(self->resources);
    Py_VISIT(self->releasers);
    Py_VISIT(self->raw);
    Py_VISIT(self->owned);
    Py_VISIT(self->all);
    Py_VISIT(self->observers);
    Py_VISIT(self->tasks);
    Py_VISIT(self->plan_owner);
    Py_VISIT(self->in_plan);
    Py_VISIT(self->errors);
    Py_VISIT(self->flushes);
    return 0;
}

static int
LedgerCore_clear(LedgerCoreObject *self)
{
    Py_CLEAR(self->resources);
    Py_CLEAR(self->releasers);
    Py_CLEAR(self->raw);
    Py_CLEAR(self->owned);
    Py_CLEAR(self->all);
    Py_CLEAR(self->observers);
    Py_CLEAR(self->tasks);
    Py_CLEAR(self->plan_owner);
    Py_CLEAR(self->in_plan);
    Py_CLEAR(self->errors);
    Py_CLEAR(self->flushes);
    return 0;
}

static void
LedgerCore_dealloc(LedgerCoreObject *self)
{
    PyObject_GC_UnTrack(self);
    LedgerCore_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Add `h` to what `owner` owns (`_owns`: None, one handle, or a list). */
static int
link_owner(HolderObject *owner, PyObject *h)
{
    PyObject *cur = owner->owns;
    if (cur == NULL || cur == Py_None) {
        Py_INCREF(h);
        Py_XSETREF(owner->owns, h);
        return 0;
    }
    if (PyList_CheckExact(cur))
        return PyList_Append(cur, h);
    PyObject *pair = PyList_New(2);
    if (pair == NULL)
        return -1;
    Py_INCREF(cur);
    PyList_SET_ITEM(pair, 0, cur);
    Py_INCREF(h);
    PyList_SET_ITEM(pair, 1, h);
    Py_SETREF(owner->owns, pair);
    return 0;
}

/* Remove `h` (by identity) from the list `lst`; -1 with ValueError when absent. */
static int
list_remove_identity(PyObject *lst, PyObject *h)
{
    Py_ssize_t n = PyList_GET_SIZE(lst);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (PyList_GET_ITEM(lst, i) == h)
            return PyList_SetSlice(lst, i, i + 1, NULL);
    }
    PyErr_SetString(PyExc_ValueError, "list.remove(x): x not in list");
    return -1;
}

static int
list_contains_identity(PyObject *lst, PyObject *h)
{
    Py_ssize_t n = PyList_GET_SIZE(lst);
    for (Py_ssize_t i = 0; i < n; i++)
        if (PyList_GET_ITEM(lst, i) == h)
            return 1;
    return 0;
}

/* Drop `h` from what `owner` owns (`_unlink` on the slot); 0, or -1 with ValueError when
 * the list does not hold it. */
static int
unlink_owner(HolderObject *owner, PyObject *h)
{
    PyObject *now = owner->owns;
    if (now != NULL && PyList_CheckExact(now)) {
        if (list_remove_identity(now, h) < 0)
            return -1;
        if (PyList_GET_SIZE(now) == 1) {
            PyObject *last = PyList_GET_ITEM(now, 0);
            Py_INCREF(last);
            Py_SETREF(owner->owns, last);
        }
    } else if (now == h) {
        Py_INCREF(Py_None);
        Py_SETREF(owner->owns, Py_None);
    }
    return 0;
}

/* ledger._planning(owner) is true (1), false (0), or raised (-1). An instance whose
 * plan runs (its `_q` PLAN_RUNNING, or a QueuedInPlan) is answered here, as the
 * Python's last test answers it: what a releaser acquires or is given in its own plan
 * makes no Python call. */
static int
planning(LedgerCoreObject *self, PyObject *owner)
{
    if (Holder_Check(owner)) {
        PyObject *q = ((HolderObject *)owner)->q;
        if (q != NULL && (q == PLAN_RUNNING || Py_TYPE(q) == QueuedType))
            return 1;
    }
    PyObject *r = call_method((PyObject *)self, s_planning, &owner, 1);
    if (r == NULL)
        return -1;
    int t = PyObject_IsTrue(r);
    Py_DECREF(r);
    return t;
}

/* ledger._release_late(h) when `owner` is terminal and not in its plan. */
static int
release_if_late(LedgerCoreObject *self, HolderObject *owner, PyObject *h)
{
    int t = holder_terminal(owner);
    if (t <= 0)
        return t;
    int p = planning(self, (PyObject *)owner);
    if (p != 0)
        return p < 0 ? -1 : 0;
    PyObject *r = call_method((PyObject *)self, s_release_late, &h, 1);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

static PyObject *
fallback(PyObject *self, PyObject *name, PyObject *const *args, size_t nargsf,
         PyObject *kwnames)
{
    PyObject *meth = PyObject_GetAttr(self, name);
    if (meth == NULL)
        return NULL;
    PyObject *r = PyObject_Vectorcall(meth, args, PyVectorcall_NARGS(nargsf), kwnames);
    Py_DECREF(meth);
    return r;
}

/* Ledger._compact: `_all` becomes a new list of the handles not released, as the
 * Python's does (a walk of the old list, `_iter()`'s, goes on over the old one); the
 * next compaction when it doubles. The old list is let go of once the new one is in
 * place: freeing a handle may run code (its last owner's finalizer) that acquires. */
static int
compact_py(LedgerCoreObject *self)
{
    PyObject *r = call_method((PyObject *)self, s_compact_py, NULL, 0);
    Py_XDECREF(r);
    return r == NULL ? -1 : 0;
}

static int
ledger_compact(LedgerCoreObject *self)
{
    PyObject *all = self->all;
    if (all == NULL || !PyList_CheckExact(all))
        return compact_py(self);
    Py_ssize_t n = PyList_GET_SIZE(all), kept = 0;
    PyObject **items = ((PyListObject *)all)->ob_item;
    for (Py_ssize_t i = 0; i < n; i++) {  /* every one ours? (else: the Python) */
        if (Py_TYPE(items[i]) != HandleType)
            return compact_py(self);
        kept += SLOT(items[i], H_RELEASED) == Py_False;
    }
    PyObject *live = PyList_New(kept);
    if (live == NULL)
        return -1;
    for (Py_ssize_t i = 0, k = 0; i < n; i++) {
        PyObject *h = items[i];
        if (SLOT(h, H_RELEASED) == Py_False) {
            Py_INCREF(h);
            PyList_SET_ITEM(live, k++, h);
        }
    }
    self->all = live;  /* (the old list's reference is ours until here) */
    self->compact_at = 2 * kept > COMPACT_MIN ? 2 * kept : COMPACT_MIN;
    Py_DECREF(all);
    return 0;
}

static PyObject *
LedgerCore_compact(LedgerCoreObject *self, PyObject *unused)
{
    if (!configured)
        return call_method((PyObject *)self, s_compact_py, NULL, 0);
    if (ledger_compact(self) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* Ledger.acquire(owner, kind, value): see `Ledger._acquire_py`. */
static PyObject *
LedgerCore_acquire(LedgerCoreObject *self, PyObject *const *args, size_t nargsf,
                   PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs != 3 || kwnames != NULL || !configured || self->releasers == NULL
            || self->all == NULL || !PyDict_CheckExact(self->releasers)
            || !PyList_CheckExact(self->all))
        return fallback((PyObject *)self, s_acquire_py, args, nargsf, kwnames);
    PyObject *owner = args[0], *kind = args[1];
    int known = PyDict_Contains(self->releasers, kind);
    if (known < 0)
        return NULL;
    if (!known || !Holder_Check(owner))
        return fallback((PyObject *)self, s_acquire_py, args, nargsf, kwnames);
    HolderObject *o = (HolderObject *)owner;
    if (o->m == NULL || !MachineCore_Check(o->m)
            || ((MachineCoreObject *)o->m)->ledger != (PyObject *)self)
        return fallback((PyObject *)self, s_acquire_py, args, nargsf, kwnames);
    PyObject *hargs[3] = {kind, args[2], owner};
    PyObject *h = PyObject_Vectorcall((PyObject *)HandleType, hargs, 3, NULL);
    if (h == NULL)
        return NULL;
    if (link_owner(o, h) < 0)
        goto error;
    if (PyList_Append(self->all, h) < 0)
        goto error;
    if (PyList_GET_SIZE(self->all) >= self->compact_at && ledger_compact(self) < 0)
        goto error;
    if (release_if_late(self, o, h) < 0)
        goto error;
    return h;
error:
    Py_DECREF(h);
    return NULL;
}

/* Ledger.transfer(handle, to): see `Ledger._transfer_py`. */
static PyObject *
LedgerCore_transfer(LedgerCoreObject *self, PyObject *const *args, size_t nargsf,
                    PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs != 2 || kwnames != NULL || !configured)
        return fallback((PyObject *)self, s_transfer_py, args, nargsf, kwnames);
    PyObject *handle = args[0], *to = args[1];
    if (Py_TYPE(handle) != HandleType || SLOT(handle, H_RELEASED) != Py_False)
        return fallback((PyObject *)self, s_transfer_py, args, nargsf, kwnames);
    PyObject *owner = SLOT(handle, H_OWNER);
    if (owner == to)
        Py_RETURN_NONE;
    if (owner == NULL || !Holder_Check(to) || !Holder_Check(owner))
        return fallback((PyObject *)self, s_transfer_py, args, nargsf, kwnames);
    HolderObject *from = (HolderObject *)owner, *dst = (HolderObject *)to;
    if (dst->m == NULL || from->m == NULL || !MachineCore_Check(dst->m)
            || !MachineCore_Check(from->m)
            || ((MachineCoreObject *)dst->m)->ledger != (PyObject *)self)
        return fallback((PyObject *)self, s_transfer_py, args, nargsf, kwnames);
    PyObject *cur = from->owns;
    if (cur != handle && !(cur != NULL && PyList_CheckExact(cur)
                           && list_contains_identity(cur, handle)))
        return fallback((PyObject *)self, s_transfer_py, args, nargsf, kwnames);
    int t = holder_terminal(from);
    if (t < 0)
        return NULL;
    if (t) {  /* its owner is terminal: allowed only inside its plan (a group handing
               * its references to its children); otherwise the Python's error */
        int p = planning(self, owner);
        if (p < 0)
            return NULL;
        if (!p)
            return fallback((PyObject *)self, s_transfer_py, args, nargsf, kwnames);
    }
    /* `from` and `to` may be released by the stores below: hold them. */
    Py_INCREF(owner);
    Py_INCREF(handle);
    int rc = unlink_owner(from, handle);
    if (rc == 0) {
        struct_set(handle, H_OWNER, to);
        rc = link_owner(dst, handle);
    }
    if (rc == 0)
        rc = release_if_late(self, dst, handle);
    Py_DECREF(handle);
    Py_DECREF(owner);
    if (rc < 0)
        return NULL;
    Py_RETURN_NONE;
}

static int
kind_is(PyObject *h, PyObject *kind)
{
    PyObject *k = SLOT(h, H_KIND);
    if (k == kind)
        return 1;
    if (k == NULL)
        return 0;
    return PyObject_RichCompareBool(k, kind, Py_EQ);
}

/* Ledger.owned(owner, kind=None): see `Ledger._owned_py`. */
static PyObject *
LedgerCore_owned(LedgerCoreObject *self, PyObject *const *args, size_t nargsf,
                 PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs < 1 || nargs > 2 || kwnames != NULL || !configured || !Holder_Check(args[0]))
        return fallback((PyObject *)self, s_owned_py, args, nargsf, kwnames);
    PyObject *kind = nargs == 2 ? args[1] : Py_None;
    PyObject *cur = ((HolderObject *)args[0])->owns;
    if (cur == NULL || cur == Py_None)
        return PyList_New(0);
    if (Py_TYPE(cur) == HandleType) {
        if (kind != Py_None) {
            int is = kind_is(cur, kind);
            if (is < 0)
                return NULL;
            if (!is)
                return PyList_New(0);
        }
        PyObject *out = PyList_New(1);
        if (out == NULL)
            return NULL;
        Py_INCREF(cur);
        PyList_SET_ITEM(out, 0, cur);
        return out;
    }
    if (!PyList_CheckExact(cur))
        return fallback((PyObject *)self, s_owned_py, args, nargsf, kwnames);
    if (kind == Py_None)
        return PyList_GetSlice(cur, 0, PyList_GET_SIZE(cur));
    PyObject *out = PyList_New(0);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(cur); i++) {
        PyObject *h = PyList_GET_ITEM(cur, i);
        int is;
        if (Py_TYPE(h) == HandleType) {
            is = kind_is(h, kind);
        } else {
            PyObject *k = PyObject_GetAttrString(h, "kind");
            if (k == NULL) {
                Py_DECREF(out);
                return NULL;
            }
            is = PyObject_RichCompareBool(k, kind, Py_EQ);
            Py_DECREF(k);
        }
        if (is < 0 || (is && PyList_Append(out, h) < 0)) {
            Py_DECREF(out);
            return NULL;
        }
    }
    return out;
}

static PyMethodDef LedgerCore_methods[] = {
    {"acquire", (PyCFunction)(void (*)(void))LedgerCore_acquire,
     METH_FASTCALL | METH_KEYWORDS,
     "Record that `owner` now owns `value`; returns its handle.\n\n"
     "When `owner` is already terminal, the handle is released at once (I6) and\n"
     "returned marked released."},
    {"transfer", (PyCFunction)(void (*)(void))LedgerCore_transfer,
     METH_FASTCALL | METH_KEYWORDS,
     "Move ownership of `handle` to `to`; released at once if `to` is terminal."},
    {"owned", (PyCFunction)(void (*)(void))LedgerCore_owned, METH_FASTCALL | METH_KEYWORDS,
     "The unreleased handles `owner` owns now, of `kind` if given, in acquire order."},
    {"_compact", (PyCFunction)LedgerCore_compact, METH_NOARGS,
     "Drop released handles from `_all`; the next compaction waits until it doubles."},
    {NULL}
};

static PyMemberDef LedgerCore_members[] = {
    {"resources", T_OBJECT_EX, offsetof(LedgerCoreObject, resources), 0,
     "What effects read as ctx.resources (pools, registry, transport)."},
    {"_releasers", T_OBJECT_EX, offsetof(LedgerCoreObject, releasers), 0, NULL},
    {"_raw", T_OBJECT_EX, offsetof(LedgerCoreObject, raw), 0, NULL},
    {"_owned", T_OBJECT_EX, offsetof(LedgerCoreObject, owned), 0, NULL},
    {"_all", T_OBJECT_EX, offsetof(LedgerCoreObject, all), 0, NULL},
    {"_compact_at", T_PYSSIZET, offsetof(LedgerCoreObject, compact_at), 0, NULL},
    {"_observers", T_OBJECT_EX, offsetof(LedgerCoreObject, observers), 0, NULL},
    {"_tasks", T_OBJECT_EX, offsetof(LedgerCoreObject, tasks), 0, NULL},
    {"_plan_owner", T_OBJECT_EX, offsetof(LedgerCoreObject, plan_owner), 0, NULL},
    {"_in_plan", T_OBJECT_EX, offsetof(LedgerCoreObject, in_plan), 0, NULL},
    {"errors", T_OBJECT_EX, offsetof(LedgerCoreObject, errors), 0,
     "Errors of async steps and of late releases, in the order they happened."},
    {"_released", T_PYSSIZET, offsetof(LedgerCoreObject, released), 0, NULL},
    {"_flushes", T_OBJECT_EX, offsetof(LedgerCoreObject, flushes), 0, NULL},
    {"late_released", T_PYSSIZET, offsetof(LedgerCoreObject, late_released), 0,
     "Handles released at once because their owner was already terminal (I6)."},
    {NULL}
};

static PyTypeObject LedgerCoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "terminus.fsm._engine.LedgerCore",
    .tp_doc = "The slots of a ledger, and its acquire, transfer and owned for the "
              "engine's instances.",
    .tp_basicsize = sizeof(LedgerCoreObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_dealloc = (destructor)LedgerCore_dealloc,
    .tp_traverse = (traverseproc)LedgerCore_traverse,
    .tp_clear = (inquiry)LedgerCore_clear,
    .tp_methods = LedgerCore_methods,
    .tp_members = LedgerCore_members,
};

/* -- PlanCell ----------------------------------------------------------------------- */

typedef struct {
    PyObject *kind;   /* the Release step's kind; NULL for an Action */
    PyObject *fn;     /* the function called unwrapped; NULL: the kind's default releaser */
    PyObject *about;  /* (step name, best_effort) */
} Step;

typedef struct {
    PyObject_HEAD
    vectorcallfunc vectorcall;
    PyObject *target;   /* the terminal state's id */
    PyObject *edge;     /* plan._Edge */
    PyObject *tname;    /* its target's name (edge.target), stored in a context it makes */
    PyObject *eledger;  /* edge.ledger, likewise */
    PyObject *pname;
    PyObject *mname;
    PyObject *runs;     /* the machine's Stats._runs (a list) */
    Py_ssize_t pid;
    PyObject *ledger;   /* a LedgerCore */
    PyObject *spare;    /* a dead context nobody kept, to reuse */
    Py_ssize_t nsteps;
    Step *steps;
} PlanCellObject;

static PyTypeObject PlanCellType;

/* Add `h` to the report's released handles (`_released`: None, one, or a list). */
static int
report_released(PyObject *report, PyObject *h)
{
    PyObject *done = SLOT(report, R_RELEASED);
    if (done == NULL || done == Py_None) {
        struct_set(report, R_RELEASED, h);
        return 0;
    }
    if (PyList_CheckExact(done))
        return PyList_Append(done, h);
    PyObject *pair = PyList_New(2);
    if (pair == NULL)
        return -1;
    Py_INCREF(done);
    PyList_SET_ITEM(pair, 0, done);
    Py_INCREF(h);
    PyList_SET_ITEM(pair, 1, h);
    struct_set(report, R_RELEASED, pair);
    Py_DECREF(pair);
    return 0;
}

/* The outcome of one step's call, `res` (NULL: it raised). A step's Exception goes to
 * the report (`step_failed`), anything it returned to `step_returned`; 0, or -1 when
 * that raised or the step raised a BaseException that is not an Exception (which the
 * Python's `except Exception` does not catch either). */
static PyObject *about_for(PyObject *about, PyObject *kind);

static int
step_outcome(PyObject *ledger, PyObject *res, PyObject *report, PyObject *about,
             PyObject *kind)
{
    if (res == Py_None) {  /* the common case: nothing to report, no name to build */
        Py_DECREF(res);
        return 0;
    }
    PyObject *exc = NULL;
    if (res == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_Exception))
            return -1;
        if ((exc = fetch_exception()) == NULL)
            return -1;
    }
    /* The step's name: `about`'s, or "release <kind>" for a handle a Release(None) or
     * the sweep released (made only here, as the Python makes it). */
    PyObject *ab = kind == NULL ? Py_NewRef(about) : about_for(about, kind);
    PyObject *r = NULL;
    if (ab != NULL) {
        if (exc != NULL) {
            PyObject *args[3] = {report, ab, exc};
            r = PyObject_Vectorcall(step_failed, args, 3, NULL);
        } else {
            PyObject *args[4] = {ledger, res, report, ab};
            r = PyObject_Vectorcall(step_returned, args, 4, NULL);
        }
        Py_DECREF(ab);
    }
    Py_XDECREF(exc);
    Py_XDECREF(res);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

/* The releaser of a step, or the kind's default one (`ledger._raw[kind]`); NULL with
 * KeyError set when the ledger has none. Borrowed. */
static PyObject *
releaser(LedgerCoreObject *ledger, PyObject *fn, PyObject *kind)
{
    if (fn != NULL)
        return fn;
    if (ledger->raw == NULL) {
        PyErr_SetString(PyExc_AttributeError, "_raw");
        return NULL;
    }
    PyObject *f = PyDict_GetItemWithError(ledger->raw, kind);
    if (f == NULL && !PyErr_Occurred())
        PyErr_SetObject(PyExc_KeyError, kind);
    return f;
}

/* A handle marked released forgets its owner (`Ledger._mark_released`): a terminal
 * instance is freed when nothing else holds it, not when the ledger next compacts its
 * list of every handle. Holding nothing then that could be part of a cycle (its value
 * an int, a str, None), it leaves the collector, as msgspec leaves such a struct. */
static void
forget_owner(PyObject *h)
{
    slot_set(h, H_OWNER, Py_None);
    PyObject *v = SLOT(h, H_VALUE);
    if (!PyObject_IS_GC(v) || (PyTuple_CheckExact(v) && !PyObject_GC_IsTracked(v)))
        PyObject_GC_UnTrack(h);
}

/* Release `h`, which `owner` owns now: marked first (never twice), dropped from the
 * owner's slot and the observers, counted, added to the report, then its releaser
 * called. 0, or -1 for an error that is not the releaser's own. */
static int
release_one(LedgerCoreObject *ledger, PyObject *ctx, HolderObject *owner, PyObject *h,
            PyObject *fn, PyObject *report, PyObject *about, int by_kind)
{
    int rc;
    Py_INCREF(h);
    struct_set(h, H_RELEASED, Py_True);
    if (unlink_owner(owner, h) < 0)
        goto error;
    forget_owner(h);  /* (the caller holds `owner`: it is the plan's instance) */
    if (ledger->observers != NULL && PyDict_GET_SIZE(ledger->observers)) {
        int has = PyDict_Contains(ledger->observers, h);
        if (has < 0 || (has && PyDict_DelItem(ledger->observers, h) < 0))
            goto error;
    }
    ledger->released++;
    if (report_released(report, h) < 0)
        goto error;
    PyObject *f = releaser(ledger, fn, SLOT(h, H_KIND));
    PyObject *res = NULL;
    if (f != NULL) {
        Py_INCREF(f);
        PyObject *args[2] = {ctx, h};
        res = PyObject_Vectorcall(f, args, 2, NULL);
        Py_DECREF(f);
    }
    /* (`by_kind`: the step is named "release <kind>" if it needs a name) */
    rc = step_outcome((PyObject *)ledger, res, report, about, by_kind ? SLOT(h, H_KIND) : NULL);
    Py_DECREF(h);
    return rc;
error:
    Py_DECREF(h);
    return -1;
}

/* The step's name for a handle of `kind`: about[0], or "release <kind>". A new
 * (name, best_effort) tuple, or `about` itself. */
static PyObject *
about_for(PyObject *about, PyObject *kind)
{
    int named = PyObject_IsTrue(PyTuple_GET_ITEM(about, 0));
    if (named < 0)
        return NULL;
    if (named) {
        Py_INCREF(about);
        return about;
    }
    PyObject *name = PyUnicode_FromFormat("release %S", kind);
    if (name == NULL)
        return NULL;
    PyObject *out = PyTuple_Pack(2, name, PyTuple_GET_ITEM(about, 1));
    Py_DECREF(name);
    return out;
}

/* `Ledger._release_kind`: each handle of `kind` (every one for None) in the snapshot of
 * `cur` that `owner` still owns, released in order. */
static int
release_kind(LedgerCoreObject *ledger, PyObject *ctx, HolderObject *owner, PyObject *cur,
             PyObject *kind, PyObject *fn, PyObject *report, PyObject *about)
{
    /* A snapshot (releases change `cur`): its handles held in a C array, no tuple made
     * for the few an owner has. */
    PyObject *few[16], **snap = few;
    Py_ssize_t n;
    if (PyList_CheckExact(cur) || PyTuple_CheckExact(cur)) {
        n = PySequence_Fast_GET_SIZE(cur);
        if (n > 16 && (snap = PyMem_Malloc(n * sizeof(PyObject *))) == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        PyObject **items = PySequence_Fast_ITEMS(cur);
        for (Py_ssize_t i = 0; i < n; i++) {
            snap[i] = items[i];
            Py_INCREF(snap[i]);
        }
    } else if (Py_TYPE(cur) == HandleType) {  /* one handle, as a snapshot of one */
        n = 1;
        few[0] = cur;
        Py_INCREF(cur);
    } else {
        PyErr_Format(PyExc_TypeError, "what an instance owns is a Handle or a list, not %R",
                     cur);
        return -1;
    }
    int rc = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *h = snap[i];
        if (Py_TYPE(h) != HandleType) {
            PyErr_Format(PyExc_TypeError, "%R is not a Handle", h);
            rc = -1;
            break;
        }
        if (kind != Py_None) {
            int is = kind_is(h, kind);
            if (is < 0) {
                rc = -1;
                break;
            }
            if (!is)
                continue;
        }
        if (SLOT(h, H_RELEASED) != Py_False || SLOT(h, H_OWNER) != (PyObject *)owner)
            continue;
        if ((rc = release_one(ledger, ctx, owner, h, fn, report, about, 1)) < 0)
            break;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        Py_DECREF(snap[i]);
    if (snap != few)
        PyMem_Free(snap);
    return rc;
}

static int
PlanCell_traverse(PlanCellObject *self, visitproc visit, void *arg)
{
    Py_VISIT(self->target);
    Py_VISIT(self->edge);
    Py_VISIT(self->tname);
    Py_VISIT(self->eledger);
    Py_VISIT(self->pname);
    Py_VISIT(self->mname);
    Py_VISIT(self->runs);
    Py_VISIT(self->ledger);
    Py_VISIT(self->spare);
    for (Py_ssize_t i = 0; i < self->nsteps; i++) {
        Py_VISIT(self->steps[i].kind);
        Py_VISIT(self->steps[i].fn);
        Py_VISIT(self->steps[i].about);
    }
    return 0;
}

static int
PlanCell_clear(PlanCellObject *self)
{
    Py_CLEAR(self->target);
    Py_CLEAR(self->edge);
    Py_CLEAR(self->tname);
    Py_CLEAR(self->eledger);
    Py_CLEAR(self->pname);
    Py_CLEAR(self->mname);
    Py_CLEAR(self->runs);
    Py_CLEAR(self->ledger);
    Py_CLEAR(self->spare);
    for (Py_ssize_t i = 0; i < self->nsteps; i++) {
        Py_CLEAR(self->steps[i].kind);
        Py_CLEAR(self->steps[i].fn);
        Py_CLEAR(self->steps[i].about);
    }
    return 0;
}

static void
PlanCell_dealloc(PlanCellObject *self)
{
    PyObject_GC_UnTrack(self);
    PlanCell_clear(self);
    PyMem_Free(self->steps);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* The plan's steps, in order, in the live context `ctx`; 0, or -1 for an error that is
 * not a step's own (a step's goes to the report). */
static int
run_steps(PlanCellObject *self, PyObject *ctx, HolderObject *inst, PyObject *report)
{
    LedgerCoreObject *ledger = (LedgerCoreObject *)self->ledger;
    for (Py_ssize_t i = 0; i < self->nsteps; i++) {
        Step *st = &self->steps[i];
        if (st->kind == NULL) {  /* an Action, called unwrapped */
            PyObject *res = PyObject_Vectorcall(st->fn, &ctx, 1, NULL);
            if (step_outcome((PyObject *)ledger, res, report, st->about, NULL) < 0)
                return -1;
            continue;
        }
        PyObject *cur = inst->owns;  /* a Release(kind): what it owns now */
        if (cur == NULL || cur == Py_None)
            continue;
        if (Py_TYPE(cur) != HandleType) {  /* several handles */
            Py_INCREF(cur);
            int rc = release_kind(ledger, ctx, inst, cur, st->kind, st->fn, report,
                                  st->about);
            Py_DECREF(cur);
            if (rc < 0)
                return -1;
            continue;
        }
        if (SLOT(cur, H_RELEASED) != Py_False)
            continue;
        int is = kind_is(cur, st->kind);
        if (is < 0)
            return -1;
        if (is && release_one(ledger, ctx, inst, cur, st->fn, report, st->about, 0) < 0)
            return -1;
    }
    /* The handles no step named, by their kinds' default releasers; again those a
     * releaser gave it meanwhile (the plan's), `_SWEEPS` passes at most (`Ledger._sweep`). */
    for (Py_ssize_t pass = 0; pass < SWEEPS; pass++) {
        PyObject *cur = inst->owns;
        if (cur == NULL || cur == Py_None)
            return 0;
        Py_INCREF(cur);
        int rc = release_kind(ledger, ctx, inst, cur, Py_None, NULL, report, SWEPT);
        Py_DECREF(cur);
        if (rc < 0)
            return -1;
    }
    PyObject *cur = inst->owns;
    if (cur != NULL && cur != Py_None) {
        Py_INCREF(cur);
        PyObject *args[3] = {(PyObject *)inst, cur, report};
        PyObject *r = call_method(self->ledger, s_sweep_failed, args, 3);
        Py_DECREF(cur);
        if (r == NULL)
            return -1;
        Py_DECREF(r);
    }
    return 0;
}

static PyObject *
drain_after_plan(HolderObject *inst, PyObject *q, PyObject *errors, PyObject *report)
{
    PyObject *args[4] = {(PyObject *)inst, q, errors, report};
    return call_method(inst->m, s_drain_after_plan, args, report == NULL ? 3 : 4);
}

static PyObject *
PlanCell_vectorcall(PlanCellObject *self, PyObject *const *args, size_t nargsf,
                    PyObject *kwnames)
{
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs != 2 || kwnames != NULL) {
        PyErr_SetString(PyExc_TypeError, "a plan cell takes (instance, event)");
        return NULL;
    }
    if (!Holder_Check(args[0])) {
        PyErr_Format(PyExc_TypeError, "a plan cell runs for an engine instance, not %R",
                     args[0]);
        return NULL;
    }
    HolderObject *inst = (HolderObject *)args[0];
    PyObject *event = args[1];
    PyObject *report = NULL, *ctx;
    Py_INCREF(inst);  /* held until the end: its plan may drop every other reference */
    Py_INCREF(self->target);
    Py_XSETREF(inst->s, self->target);
    Py_INCREF(PLAN_RUNNING);
    Py_XSETREF(inst->q, PLAN_RUNNING);

    ctx = self->spare;
    self->spare = NULL;
    if (ctx == NULL) {
        ctx = ContextType->tp_alloc(ContextType, 0);  /* `plan._made(edge)` */
        if (ctx == NULL)
            goto failed;
        slot_set(ctx, C_EDGE, self->edge);
        slot_set(ctx, C_TARGET, self->tname);
        slot_set(ctx, C_LEDGER, self->eledger);
    }
    {
        PyObject *res = ((LedgerCoreObject *)self->ledger)->resources;
        slot_set(ctx, C_RESOURCES, res == NULL ? Py_None : res);
    }
    slot_set(ctx, C_LIVE, Py_True);  /* live until the plan is done (I1) */
    slot_set(ctx, C_INSTANCE, (PyObject *)inst);
    slot_set(ctx, C_EVENT, event);
    PyObject *rargs[3] = {self->mname, (PyObject *)inst, self->pname};
    report = PyObject_Vectorcall((PyObject *)ReportType, rargs, 3, NULL);
    int rc = report == NULL ? -1 : run_steps(self, ctx, inst, report);
    slot_set(ctx, C_LIVE, Py_False);
    /* Nobody kept it, and no effect rebound what it says of its edge (the next plan
     * would read that): cleared, it is the next plan's. */
    if (Py_REFCNT(ctx) == 1 && SLOT(ctx, C_TARGET) == self->tname
            && SLOT(ctx, C_LEDGER) == self->eledger) {
        PyObject *et, *ev, *etb;
        PyErr_Fetch(&et, &ev, &etb);
        slot_set(ctx, C_INSTANCE, Py_None);
        slot_set(ctx, C_EVENT, Py_None);
        PyErr_Restore(et, ev, etb);
        if (self->spare == NULL && Py_REFCNT(ctx) == 1)
            self->spare = ctx;
        else
            Py_DECREF(ctx);
    } else {
        Py_DECREF(ctx);
    }
    if (rc < 0)
        goto failed;
    {
        PyObject *runs = self->runs;  /* runs[pid] += 1 */
        if (!PyList_CheckExact(runs) || self->pid >= PyList_GET_SIZE(runs)) {
            PyErr_SetString(PyExc_IndexError, "plan runs index out of range");
            goto failed;
        }
        PyObject *old = PyList_GET_ITEM(runs, self->pid);
        PyObject *now = PyNumber_Add(old, ONE);
        if (now == NULL)
            goto failed;
        PyList_SET_ITEM(runs, self->pid, now);
        Py_DECREF(old);
    }
    PyObject *errors = SLOT(report, R_ERRORS);
    if (errors != NULL && errors != Py_None) {
        int any = PyObject_IsTrue(errors);
        if (any < 0)
            goto failed;
        if (any) {
            PyObject *a[2] = {report, self->ledger};
            PyObject *r = call_method(inst->m, s_plan_failed, a, 2);
            if (r == NULL)
                goto failed;
            Py_DECREF(r);
        }
    }
    if (inst->q != PLAN_RUNNING) {  /* events its effects fired at this instance */
        PyObject *q = inst->q;
        Py_INCREF(q);
        PyObject *errs = PyList_New(0);
        PyObject *r = errs == NULL ? NULL : drain_after_plan(inst, q, errs, report);
        Py_XDECREF(errs);
        Py_DECREF(q);
        Py_DECREF(report);
        Py_DECREF(inst);
        return r;
    }
    Py_INCREF(Py_None);
    Py_SETREF(inst->q, Py_None);
    Py_DECREF(inst);
    return report;

failed:
    /* `except Exception as e`: an instance nothing was queued at is no longer busy and
     * the error is raised; else the queued events run first (`_drain_after_plan`). */
    Py_XDECREF(report);
    if (!PyErr_ExceptionMatches(PyExc_Exception)) {
        Py_DECREF(inst);
        return NULL;
    }
    if (inst->q == PLAN_RUNNING) {
        PyObject *et, *ev, *etb;
        PyErr_Fetch(&et, &ev, &etb);
        Py_INCREF(Py_None);
        Py_SETREF(inst->q, Py_None);
        PyErr_Restore(et, ev, etb);
        Py_DECREF(inst);
        return NULL;
    }
    {
        PyObject *exc = fetch_exception();
        PyObject *q = inst->q;
        Py_INCREF(q);
        PyObject *errs = PyList_New(1);
        PyObject *r = NULL;
        if (errs != NULL) {
            PyList_SET_ITEM(errs, 0, exc);
            r = drain_after_plan(inst, q, errs, NULL);
            Py_DECREF(errs);
        } else {
            Py_DECREF(exc);
        }
        Py_DECREF(q);
        Py_DECREF(inst);
        return r;
    }
}

static PyObject *
PlanCell_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"target", "edge", "pname", "pid", "mname", "runs", "ledger",
                             "steps", NULL};
    PyObject *target, *edge, *pname, *mname, *runs, *ledger, *steps;
    Py_ssize_t pid;
    if (require_configured() < 0)
        return NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOUnUO!O!O!:PlanCell", kwlist, &target,
                                     &edge, &pname, &pid, &mname, &PyList_Type, &runs,
                                     &LedgerCoreType, &ledger, &PyTuple_Type, &steps))
        return NULL;
    if (pid < 0) {
        PyErr_SetString(PyExc_ValueError, "pid must be >= 0");
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(steps);
    Step *arr = PyMem_Calloc(n ? n : 1, sizeof(Step));
    if (arr == NULL)
        return PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *st = PyTuple_GET_ITEM(steps, i);
        if (!PyTuple_Check(st) || PyTuple_GET_SIZE(st) != 3) {
            PyErr_SetString(PyExc_TypeError, "each step is (kind or None, fn or None, about)");
            goto bad;
        }
        PyObject *kind = PyTuple_GET_ITEM(st, 0), *fn = PyTuple_GET_ITEM(st, 1);
        PyObject *about = PyTuple_GET_ITEM(st, 2);
        if (!PyTuple_Check(about) || PyTuple_GET_SIZE(about) != 2) {
            PyErr_SetString(PyExc_TypeError, "a step's about is (name, best_effort)");
            goto bad;
        }
        if (kind == Py_None && fn == Py_None) {
            PyErr_SetString(PyExc_TypeError, "an Action step needs its function");
            goto bad;
        }
        arr[i].kind = kind == Py_None ? NULL : Py_NewRef(kind);
        arr[i].fn = fn == Py_None ? NULL : Py_NewRef(fn);
        arr[i].about = Py_NewRef(about);
    }
    PyObject *tname = PyObject_GetAttrString(edge, "target");
    PyObject *eledger = tname == NULL ? NULL : PyObject_GetAttrString(edge, "ledger");
    if (eledger == NULL) {
        Py_XDECREF(tname);
        goto bad;
    }
    PlanCellObject *self = (PlanCellObject *)type->tp_alloc(type, 0);
    if (self == NULL) {
        Py_DECREF(tname);
        Py_DECREF(eledger);
        goto bad;
    }
    self->tname = tname;
    self->eledger = eledger;
    self->vectorcall = (vectorcallfunc)PlanCell_vectorcall;
    self->target = Py_NewRef(target);
    self->edge = Py_NewRef(edge);
    self->pname = Py_NewRef(pname);
    self->mname = Py_NewRef(mname);
    self->runs = Py_NewRef(runs);
    self->pid = pid;
    self->ledger = Py_NewRef(ledger);
    self->nsteps = n;
    self->steps = arr;
    return (PyObject *)self;
bad:
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_XDECREF(arr[i].kind);
        Py_XDECREF(arr[i].fn);
        Py_XDECREF(arr[i].about);
    }
    PyMem_Free(arr);
    return NULL;
}

static PyObject *
PlanCell_repr(PlanCellObject *self)
{
    return PyUnicode_FromFormat("<compiled plan %U:%U, %zd steps>", self->mname, self->pname,
                                self->nsteps);
}

static PyTypeObject PlanCellType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "terminus.fsm._engine.PlanCell",
    .tp_doc = "A terminal edge's compiled step: PlanCell(target, edge, pname, pid, mname, "
              "runs, ledger, steps), called (instance, event).",
    .tp_basicsize = sizeof(PlanCellObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_vectorcall_offset = offsetof(PlanCellObject, vectorcall),
    .tp_call = PyVectorcall_Call,
    .tp_new = PlanCell_new,
    .tp_dealloc = (destructor)PlanCell_dealloc,
    .tp_traverse = (traverseproc)PlanCell_traverse,
    .tp_clear = (inquiry)PlanCell_clear,
    .tp_repr = (reprfunc)PlanCell_repr,
};

/* -- setup -------------------------------------------------------------------------- */

/* The offset of `type`'s object slot `name` (a member descriptor); -1 with an error. */
static Py_ssize_t
member_offset(PyTypeObject *type, const char *name)
{
    PyObject *d = PyDict_GetItemString(type->tp_dict, name);  /* borrowed */
    if (d == NULL || !Py_IS_TYPE(d, &PyMemberDescr_Type)) {
        PyErr_Format(PyExc_TypeError, "%s has no slot %s", type->tp_name, name);
        return -1;
    }
    PyMemberDef *md = ((PyMemberDescrObject *)d)->d_member;
    if ((md->type != T_OBJECT_EX && md->type != T_OBJECT) || (md->flags & READONLY)) {
        PyErr_Format(PyExc_TypeError, "%s.%s is not a writable object slot", type->tp_name,
                     name);
        return -1;
    }
    return md->offset;
}

static PyObject *
engine_setup(PyObject *module, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"Handle", "PlanReport", "ReleaseContext", "QueuedInPlan",
                             "PLAN_RUNNING", "step_failed", "step_returned", "sweeps",
                             "compact_min", NULL};
    PyObject *h, *r, *c, *qd, *busy, *failed, *returned;
    Py_ssize_t sweeps, compact_min;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!O!O!O!O!OOnn:setup", kwlist, &PyType_Type,
                                     &h, &PyType_Type, &r, &PyType_Type, &c, &PyType_Type,
                                     &qd, &PyList_Type, &busy, &failed, &returned, &sweeps,
                                     &compact_min))
        return NULL;
    if (sweeps < 1 || compact_min < 1) {
        PyErr_SetString(PyExc_ValueError, "sweeps and compact_min must be >= 1");
        return NULL;
    }
    SWEEPS = sweeps;
    COMPACT_MIN = compact_min;
    PyTypeObject *ht = (PyTypeObject *)h, *rt = (PyTypeObject *)r, *ct = (PyTypeObject *)c;
    Py_ssize_t o[13];
    if ((o[0] = member_offset(ht, "kind")) < 0 || (o[1] = member_offset(ht, "value")) < 0
            || (o[2] = member_offset(ht, "owner")) < 0
            || (o[3] = member_offset(ht, "released")) < 0
            || (o[4] = member_offset(rt, "_released")) < 0
            || (o[5] = member_offset(rt, "_errors")) < 0
            || (o[6] = member_offset(ct, "_edge")) < 0
            || (o[7] = member_offset(ct, "_live")) < 0
            || (o[8] = member_offset(ct, "event")) < 0
            || (o[9] = member_offset(ct, "instance")) < 0
            || (o[10] = member_offset(ct, "resources")) < 0
            || (o[11] = member_offset(ct, "target")) < 0
            || (o[12] = member_offset(ct, "ledger")) < 0)
        return NULL;
    H_KIND = o[0], H_VALUE = o[1], H_OWNER = o[2], H_RELEASED = o[3];
    R_RELEASED = o[4], R_ERRORS = o[5];
    C_EDGE = o[6], C_LIVE = o[7], C_EVENT = o[8], C_INSTANCE = o[9];
    C_RESOURCES = o[10], C_TARGET = o[11], C_LEDGER = o[12];
    Py_XSETREF(HandleType, (PyTypeObject *)Py_NewRef(h));
    Py_XSETREF(ReportType, (PyTypeObject *)Py_NewRef(r));
    Py_XSETREF(ContextType, (PyTypeObject *)Py_NewRef(c));
    Py_XSETREF(QueuedType, (PyTypeObject *)Py_NewRef(qd));
    Py_XSETREF(PLAN_RUNNING, Py_NewRef(busy));
    Py_XSETREF(step_failed, Py_NewRef(failed));
    Py_XSETREF(step_returned, Py_NewRef(returned));
    configured = 1;
    Py_RETURN_NONE;
}

static PyMethodDef engine_methods[] = {
    {"setup", (PyCFunction)(void (*)(void))engine_setup, METH_VARARGS | METH_KEYWORDS,
     "Give the module the Python classes and helpers it works with (ledger.py calls it)."},
    {NULL}
};

static struct PyModuleDef engine_module = {
    PyModuleDef_HEAD_INIT, "_engine",
    "The engine's hot paths, compiled (see fsm/_engine.c); the Python in fsm/ is the "
    "reference.", -1, engine_methods,
};

#define INTERN(var, s) if ((var = PyUnicode_InternFromString(s)) == NULL) return NULL

PyMODINIT_FUNC
PyInit__engine(void)
{
    INTERN(s_fire_py, "_fire_py");
    INTERN(s_fire_slow, "_fire_slow");
    INTERN(s_acquire_py, "_acquire_py");
    INTERN(s_transfer_py, "_transfer_py");
    INTERN(s_owned_py, "_owned_py");
    INTERN(s_compact_py, "_compact_py");
    INTERN(s_planning, "_planning");
    INTERN(s_release_late, "_release_late");
    INTERN(s_sweep_failed, "_sweep_failed");
    INTERN(s_plan_failed, "_plan_failed");
    INTERN(s_drain_after_plan, "_drain_after_plan");
    INTERN(s_initial, "initial");
    SWEPT = PyTuple_Pack(2, Py_None, Py_False);
    ONE = PyLong_FromLong(1);
    if (SWEPT == NULL || ONE == NULL)
        return NULL;
    if (PyType_Ready(&HolderType) < 0 || PyType_Ready(&MachineCoreType) < 0
            || PyType_Ready(&LedgerCoreType) < 0 || PyType_Ready(&PlanCellType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&engine_module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddIntConstant(m, "API", ENGINE_API) < 0
            || PyModule_AddObjectRef(m, "Holder", (PyObject *)&HolderType) < 0
            || PyModule_AddObjectRef(m, "MachineCore", (PyObject *)&MachineCoreType) < 0
            || PyModule_AddObjectRef(m, "LedgerCore", (PyObject *)&LedgerCoreType) < 0
            || PyModule_AddObjectRef(m, "PlanCell", (PyObject *)&PlanCellType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
