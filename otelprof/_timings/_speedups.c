/* The recorder's hot path in C, and nothing else: a range's enter and exit (`Timing`'s and
 * the record_function bridge's), delivering a closed range, `Recorder.begin_step` and
 * `Recorder.end_step`. Why: these few functions are most of what profiling costs the
 * training thread in Python (BENCHMARKS.md). `_recorder.py` is the reference: the same
 * frames (`_frames.py`), the same fields, every uncommon case handed to it; rules in
 * ARCHITECTURE.md, "The recorder". It looks no name up in a module: `_recorder.use_compiled`
 * hands it what it reads (`bind`; the recorder's fields, clock and thread-local included,
 * are read as they are at each call), and the attribute names below (`BOUND`) are the
 * whole binding table, exported as BINDINGS and checked at bind() and by
 * tests/test_timings_recorder.py.
 */
#include "_cpython_compat.h" /* CPython's private/unstable parts: only there */
#include <string.h>
#include <time.h>

/* frame layout: _frames.F_* (exported as FRAME_LAYOUT; _recorder binds this module only
 * when it equals _frames.LAYOUT) */
#define F_NAME 0
#define F_SPAN 1
#define F_PARENT 2
#define F_CTX 3
#define F_THREAD 4
#define F_ATTRS 5
#define F_START 6
#define F_END 7
#define F_ERROR 8
#define F_CUDA 9
#define F_KIND 10
#define F_OWNER 11
#define F_RANGE 12
#define FRAME_LEN 13    /* _frames.TIMING_LEN */
#define RF_FRAME_LEN 12 /* _frames.RF_LEN: no F_RANGE, the range is torch's own */

/* ---- the binding table: (class of _recorder.py, attribute) ---- */

enum { C_RECORDER, C_SAMPLER, C_TIMING, C_THREAD, C_CTX, C_LIMITS, C_LOCAL, C_COUNT, C_OTHER };
static const char *class_names[] = {"Recorder",    "OnThreadSampler", "Timing", "ThreadState",
                                    "StepContext", "QuietLimits",     "_Local"};

/* OTHER: public methods of what the recorder holds (its deque, its CUDA timer) and the
 * `name` of torch's record_function. */
#define BOUND(X)                                                                           \
    X(RECORDER, current) X(RECORDER, queue) X(RECORDER, capacity) X(RECORDER, chunk_size)   \
    X(RECORDER, clock) X(RECORDER, threads)                                                 \
    X(RECORDER, cuda_timer) X(RECORDER, torch_profiler_flags) X(RECORDER, in_items)         \
    X(RECORDER, out_items) X(RECORDER, hand_off) X(RECORDER, count_drop)                    \
    X(RECORDER, _queue_item)                                                                \
    X(SAMPLER, limits) X(SAMPLER, layouts) X(SAMPLER, layout_ids) X(SAMPLER, max_layouts)   \
    X(SAMPLER, long_step_ns) X(SAMPLER, capture_steps) X(SAMPLER, rows_per_item)            \
    X(SAMPLER, hand_rows) X(TIMING, name) X(TIMING, attributes) X(THREAD, stack)            \
    X(THREAD, hold) X(THREAD, rows) X(CTX, step) X(CTX, epoch) X(CTX, start_ns)             \
    X(CTX, trim_start) X(CTX, phase) X(CTX, frames) X(CTX, owner) X(CTX, kept)              \
    X(CTX, error) X(CTX, batch) X(CTX, attrs) X(LIMITS, first_unknown)                      \
    X(LIMITS, tail_tokens) X(LIMITS, slowest_ns) X(LIMITS, anomaly_ns) X(LIMITS, selected)  \
    X(LOCAL, state) X(OTHER, append) X(OTHER, enter) X(OTHER, release) X(OTHER, name)

#define ENUM(c, n) K_##c##_##n,
enum { BOUND(ENUM) K_COUNT };
#undef ENUM

/* An attribute: a __slots__ field read in place when the object is exactly of the class
 * bind() saw (no descriptor call), else looked up as usual. */
typedef struct {
    PyTypeObject *type;
    Py_ssize_t offset;
    PyObject *name; /* interned */
} Slot;

static Slot slots[K_COUNT];
#define SLOT(c, n) (&slots[K_##c##_##n])
#define NAME(c, n) (slots[K_##c##_##n].name)

/* ---- what bind() hands over (strong references) ---- */

static PyObject *recorder; /* _recorder.recorder: its fields are read by offset */
static PyObject *sampler;  /* _recorder.on_thread */
static PyObject *py_timing_exit, *py_begin_step, *py_end_step; /* the Python twins */
static PyObject *make_thread_state, *torch_range_enter;
static PyObject *kind_timing, *kind_rf, *kind_step, *phase_train, *step_span;
static Py_ssize_t max_depth;
static PyObject *zero, *real_clock; /* 0, time.perf_counter_ns */

static int
check_bound(void)
{
    if (recorder == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "otelprof._speedups: bind() was not called");
        return -1;
    }
    return 0;
}

/* 0 when `bind()` was called and a call got its `expected` arguments, else -1 with the
 * error naming them (`usage`). */
static int
bound_call(Py_ssize_t nargs, Py_ssize_t expected, const char *usage)
{
    if (nargs != expected) {
        PyErr_Format(PyExc_TypeError, "otelprof._speedups: %s", usage);
        return -1;
    }
    return check_bound();
}

static int
slot_init(Slot *slot, PyObject *cls)
{
    slot->type = NULL;
    slot->offset = 0;
    PyObject *descr = PyObject_GetAttr(cls, slot->name); /* fails for a renamed attribute */
    if (descr == NULL)
        return -1;
    Py_ssize_t offset = compat_object_slot_offset(cls, descr);
    if (offset >= 0) {
        slot->type = (PyTypeObject *)cls;
        slot->offset = offset;
    }
    Py_DECREF(descr);
    return 0;
}

static PyObject *
slot_get(Slot *slot, PyObject *obj)
{
    if (Py_TYPE(obj) == slot->type) {
        PyObject *value = *(PyObject **)((char *)obj + slot->offset);
        if (value != NULL)
            return Py_NewRef(value);
    }
    return PyObject_GetAttr(obj, slot->name);
}

/* Set the object slot at `offset` of `obj` in place. Steals `value`. */
static void
set_slot(PyObject *obj, Py_ssize_t offset, PyObject *value)
{
    PyObject **field = (PyObject **)((char *)obj + offset);
    Py_XSETREF(*field, value);
}

/* Set a slot in place (same condition as slot_get), else as an attribute. Steals `value`. */
static int
slot_set(Slot *slot, PyObject *obj, PyObject *value)
{
    if (value == NULL)
        return -1;
    if (Py_TYPE(obj) == slot->type) {
        set_slot(obj, slot->offset, value);
        return 0;
    }
    int failed = PyObject_SetAttr(obj, slot->name, value);
    Py_DECREF(value);
    return failed;
}

/* A field of the recorder (borrowed; bind() made sure each is a slot). NULL with an error
 * set when it is unset. */
static PyObject *
field(Slot *slot)
{
    PyObject *value = *(PyObject **)((char *)recorder + slot->offset);
    if (value == NULL)
        PyErr_Format(PyExc_AttributeError, "otelprof._speedups: recorder.%U is unset", slot->name);
    return value;
}

#define FIELD(n) field(SLOT(RECORDER, n))

/* `recorder.clock()` (perf_counter_ns, unless a test set another). On Linux it is
 * clock_gettime(CLOCK_MONOTONIC), read here without the call. */
static PyObject *
now(void)
{
    PyObject *clock = FIELD(clock);
    if (clock == NULL)
        return NULL;
#ifdef __linux__
    struct timespec ts;
    if (clock == real_clock && clock_gettime(CLOCK_MONOTONIC, &ts) == 0)
        return PyLong_FromLongLong((long long)ts.tv_sec * 1000000000LL + ts.tv_nsec);
#endif
    return PyObject_CallNoArgs(clock);
}

/* The thread that asked last, by its thread state's id (unique for the interpreter's life),
 * and the `recorder.threads` its state came from (a test may replace it): the training
 * thread asks for nearly every range. Strong references. */
static uint64_t last_thread_id;
static PyObject *last_threads, *last_state;

/* The calling thread's ThreadState (new reference), None if it has none and `make` is 0.
 * `threads.state` costs a thread-local lookup and a generic attribute lookup, so the last
 * thread's is kept at hand. */
static PyObject *
get_thread_state(int make)
{
    PyObject *threads = FIELD(threads);
    if (threads == NULL)
        return NULL;
    uint64_t id = compat_thread_id();
    if (id == last_thread_id && threads == last_threads && last_state != NULL)
        return Py_NewRef(last_state);
    PyObject *state = PyObject_GetAttr(threads, NAME(LOCAL, state));
    if (state == NULL)
        return NULL;
    if (state == Py_None) {
        if (!make)
            return state;
        Py_DECREF(state);
        state = PyObject_CallNoArgs(make_thread_state);
        if (state == NULL)
            return NULL;
    }
    last_thread_id = id;
    Py_XSETREF(last_threads, Py_NewRef(threads));
    Py_XSETREF(last_state, Py_NewRef(state));
    return state;
}

/* The frame (F_* layout) a range opened in `ctx` by `owner` starts as: its parent is the
 * top of `stack` when that belongs to the same step; start and end are set later. `length`
 * is FRAME_LEN for timings, one less for bridged ranges (no F_RANGE). New reference. */
static PyObject *
new_frame(Py_ssize_t length, PyObject *name, PyObject *stack, PyObject *ctx, PyObject *state,
          PyObject *attributes, PyObject *kind, PyObject *owner)
{
    Py_ssize_t depth = PyList_GET_SIZE(stack);
    PyObject *parent = Py_None;
    if (depth) {
        PyObject *top = PyList_GET_ITEM(stack, depth - 1);
        if (PyList_Check(top) && PyList_GET_SIZE(top) > F_CTX && PyList_GET_ITEM(top, F_CTX) == ctx)
            parent = top;
    }
    PyObject *frame = PyList_New(length);
    if (frame == NULL)
        return NULL;
    PyList_SET_ITEM(frame, F_NAME, Py_NewRef(name));
    PyList_SET_ITEM(frame, F_SPAN, Py_NewRef(zero));
    PyList_SET_ITEM(frame, F_PARENT, Py_NewRef(parent));
    PyList_SET_ITEM(frame, F_CTX, Py_NewRef(ctx));
    PyList_SET_ITEM(frame, F_THREAD, Py_NewRef(state));
    PyList_SET_ITEM(frame, F_ATTRS, Py_NewRef(attributes));
    PyList_SET_ITEM(frame, F_START, Py_NewRef(zero));
    PyList_SET_ITEM(frame, F_END, Py_NewRef(zero));
    PyList_SET_ITEM(frame, F_ERROR, Py_NewRef(Py_None));
    PyList_SET_ITEM(frame, F_CUDA, Py_NewRef(Py_None));
    PyList_SET_ITEM(frame, F_KIND, Py_NewRef(kind));
    PyList_SET_ITEM(frame, F_OWNER, Py_NewRef(owner));
    if (length > F_RANGE)
        PyList_SET_ITEM(frame, F_RANGE, Py_NewRef(Py_None));
    return frame;
}

/* Whether a torch profiler records now (1, 0; -1 on error): `flags[key]`, where the
 * recorder's `torch_profiler_flags` is (the dict of torch's profiler module, the key of
 * its flag), handed by `_torch_compat`. Every timing asks, so the value is kept with the
 * dict's version and looked up again only when the dict changed (a profiler that starts
 * or stops sets the flag, which changes the version). */
static PyObject *flag_dict, *flag_key; /* strong */
static PyObject *flag_value;           /* borrowed, like PyDict_GetItem's */
static uint64_t flag_version;

static int
torch_profiler_on(PyObject *flags)
{
    if (!PyTuple_Check(flags) || PyTuple_GET_SIZE(flags) != 2 ||
        !PyDict_Check(PyTuple_GET_ITEM(flags, 0))) {
        PyErr_SetString(PyExc_TypeError,
                        "otelprof._speedups: torch_profiler_flags must be (dict, key)");
        return -1;
    }
    PyObject *dict = PyTuple_GET_ITEM(flags, 0), *key = PyTuple_GET_ITEM(flags, 1);
    uint64_t version = compat_dict_version(dict);
    PyObject *value;
    if (COMPAT_VERSION_TAGS && version != 0 && dict == flag_dict && key == flag_key &&
        version == flag_version) {
        value = flag_value;
    } else {
        value = PyDict_GetItemWithError(dict, key);
        if (value == NULL && PyErr_Occurred())
            return -1;
        Py_XSETREF(flag_dict, Py_NewRef(dict));
        Py_XSETREF(flag_key, Py_NewRef(key));
        flag_value = value;
        flag_version = version;
    }
    if (value == NULL || value == Py_False || value == Py_None)
        return 0;
    return value == Py_True ? 1 : PyObject_IsTrue(value);
}

static PyObject *
timing_enter(PyObject *module, PyObject *self)
{
    if (check_bound() < 0)
        return NULL;
    PyObject *ctx = FIELD(current);
    if (ctx == NULL)
        return NULL;
    if (ctx == Py_None)
        return Py_NewRef(self);
    Py_INCREF(ctx);
    PyObject *state = NULL, *stack = NULL, *frame = NULL, *name = NULL, *opened = NULL;
    state = get_thread_state(1);
    if (state == NULL)
        goto fail;
    stack = slot_get(SLOT(THREAD, stack), state);
    if (stack == NULL)
        goto fail;
    if (!PyList_Check(stack) || PyList_GET_SIZE(stack) == 0) {
        PyErr_SetString(PyExc_RuntimeError, "otelprof._speedups: a thread's stack lost its base");
        goto fail;
    }
    name = slot_get(SLOT(TIMING, name), self);
    if (name == NULL)
        goto fail;
    PyObject *attributes = slot_get(SLOT(TIMING, attributes), self);
    if (attributes == NULL)
        goto fail;
    frame = new_frame(FRAME_LEN, name, stack, ctx, state, attributes, kind_timing, self);
    Py_DECREF(attributes);
    if (frame == NULL || PyList_Append(stack, frame) < 0)
        goto fail;

    PyObject *flags = FIELD(torch_profiler_flags);
    if (flags == NULL)
        goto fail;
    if (flags != Py_None) {
        int on = torch_profiler_on(flags);
        if (on < 0)
            goto fail;
        if (on) {
            PyObject *range = PyObject_CallOneArg(torch_range_enter, name);
            if (range == NULL || PyList_SetItem(frame, F_RANGE, range) < 0)
                goto fail;
        }
    }
    PyObject *cuda = FIELD(cuda_timer);
    if (cuda == NULL)
        goto fail;
    if (cuda != Py_None) {
        PyObject *events = PyObject_CallMethodNoArgs(cuda, NAME(OTHER, enter));
        if (events == NULL || PyList_SetItem(frame, F_CUDA, events) < 0)
            goto fail;
    }
    PyObject *start = now();
    if (start == NULL || PyList_SetItem(frame, F_START, start) < 0)
        goto fail;
    opened = Py_NewRef(self);
fail:
    Py_DECREF(ctx);
    Py_XDECREF(frame);
    Py_XDECREF(name);
    Py_XDECREF(stack);
    Py_XDECREF(state);
    return opened;
}

/* Call `recorder.<name>(arg)` (no argument when `arg` is NULL) and drop the result. */
static int
call_recorder(PyObject *name, PyObject *arg)
{
    PyObject *args[2] = {recorder, arg};
    PyObject *result = PyObject_VectorcallMethod(name, args, arg == NULL ? 1 : 2, NULL);
    if (result == NULL)
        return -1;
    Py_DECREF(result);
    return 0;
}

/* `Recorder.deliver`: a closed frame goes to its step's own list on the step's thread, else
 * to the queue. */
static int
deliver(PyObject *frame, PyObject *state)
{
    PyObject *ctx = PyList_GET_ITEM(frame, F_CTX);
    PyObject *owner = slot_get(SLOT(CTX, owner), ctx);
    if (owner == NULL)
        return -1;
    int own = owner == state;
    Py_DECREF(owner);
    if (own) {
        PyObject *frames = slot_get(SLOT(CTX, frames), ctx);
        if (frames == NULL)
            return -1;
        if (PyList_Append(frames, frame) < 0) {
            Py_DECREF(frames);
            return -1;
        }
        Py_ssize_t n = PyList_GET_SIZE(frames);
        Py_DECREF(frames);
        PyObject *chunk = FIELD(chunk_size);
        if (chunk == NULL)
            return -1;
        Py_ssize_t limit = PyLong_AsSsize_t(chunk);
        if (limit == -1 && PyErr_Occurred())
            return -1;
        if (n >= limit)
            return call_recorder(NAME(RECORDER, hand_off), ctx);
        return 0;
    }
    PyObject *queue = FIELD(queue);
    PyObject *capacity = queue == NULL ? NULL : FIELD(capacity);
    if (capacity == NULL)
        return -1;
    Py_ssize_t queued = PyObject_Length(queue);
    Py_ssize_t room = PyLong_AsSsize_t(capacity);
    if (queued < 0 || (room == -1 && PyErr_Occurred()))
        return -1;
    if (queued < room) {
        PyObject *done = PyObject_CallMethodOneArg(queue, NAME(OTHER, append), frame);
        Py_XDECREF(done);
        return done == NULL ? -1 : 0;
    }
    return call_recorder(NAME(RECORDER, count_drop), NULL);
}

/* Whether a frame on `stack` was opened by `owner`. A range with none (forgotten by
 * `forget_above`, closed twice, or opened while nothing recorded) has nothing to close: the
 * Python exits return at once for it, so the compiled ones do not call them. */
static int
owns_a_frame(PyObject *stack, PyObject *owner)
{
    if (!PyList_Check(stack))
        return 1; /* the Python exit says what is wrong */
    for (Py_ssize_t i = PyList_GET_SIZE(stack); i-- > 0;) {
        PyObject *frame = PyList_GET_ITEM(stack, i);
        if (PyList_Check(frame) && PyList_GET_SIZE(frame) > F_OWNER &&
            PyList_GET_ITEM(frame, F_OWNER) == owner)
            return 1;
    }
    return 0;
}

/* Drop the top of a thread's stack (of `depth` > 1 items: the base frame stays): what
 * `del stack[-1]` does, without a slice deletion's generic path. */
static void
pop_top(PyObject *stack, Py_ssize_t depth)
{
    PyObject *top = PyList_GET_ITEM(stack, depth - 1);
    Py_SET_SIZE(stack, depth - 1);
    Py_DECREF(top);
}

static PyObject *
timing_exit(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (bound_call(nargs, 4, "timing_exit(self, exc_type, exc, tb)") < 0)
        return NULL;
    PyObject *self = args[0];
    PyObject *state = get_thread_state(0);
    if (state == NULL)
        return NULL;
    if (state == Py_None) {
        Py_DECREF(state);
        Py_RETURN_NONE;
    }
    PyObject *stack = slot_get(SLOT(THREAD, stack), state);
    if (stack == NULL) {
        Py_DECREF(state);
        return NULL;
    }
    Py_ssize_t depth = PyList_Check(stack) ? PyList_GET_SIZE(stack) : 0;
    PyObject *frame = depth ? PyList_GET_ITEM(stack, depth - 1) : NULL;
    if (frame == NULL || !PyList_Check(frame) || PyList_GET_SIZE(frame) != FRAME_LEN ||
        PyList_GET_ITEM(frame, F_OWNER) != self || args[1] != Py_None ||
        PyList_GET_ITEM(frame, F_CUDA) != Py_None || PyList_GET_ITEM(frame, F_RANGE) != Py_None) {
        /* not on top, an exception, CUDA events or a torch range: the Python exit */
        int mine = owns_a_frame(stack, self);
        Py_DECREF(stack);
        Py_DECREF(state);
        if (!mine)
            Py_RETURN_NONE;
        return PyObject_Vectorcall(py_timing_exit, args, 4, NULL);
    }
    Py_INCREF(frame);
    pop_top(stack, depth);
    Py_DECREF(stack);
    PyObject *end = now();
    int failed = end == NULL || PyList_SetItem(frame, F_END, end) < 0 || deliver(frame, state) < 0;
    Py_DECREF(frame);
    Py_DECREF(state);
    if (failed)
        return NULL;
    Py_RETURN_NONE;
}

/* ---- torch's record_function, bridged (`_recorder.bridged_methods`) ---- */

/* `record_function.__enter__` as `bridge_enter(original_enter, self)`: torch's own enter
 * first, then the range opens as in the Python bridge (a frame of the step on this thread's
 * stack, below MAX_DEPTH, its start read last). */
static PyObject *
bridge_enter(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (bound_call(nargs, 2, "bridge_enter(original_enter, self)") < 0)
        return NULL;
    PyObject *self = args[1];
    PyObject *result = PyObject_CallOneArg(args[0], self);
    if (result == NULL)
        return NULL;
    PyObject *ctx = FIELD(current);
    if (ctx == NULL) {
        Py_DECREF(result);
        return NULL;
    }
    if (ctx == Py_None)
        return result;
    Py_INCREF(ctx);
    PyObject *state = NULL, *stack = NULL, *frame = NULL, *name = NULL, *opened = NULL;
    state = get_thread_state(1);
    stack = state == NULL ? NULL : slot_get(SLOT(THREAD, stack), state);
    if (stack == NULL)
        goto fail;
    if (!PyList_Check(stack)) {
        PyErr_SetString(PyExc_RuntimeError, "otelprof._speedups: a thread's stack is no list");
        goto fail;
    }
    name = PyObject_GetAttr(self, NAME(OTHER, name));
    if (name == NULL)
        goto fail;
    frame = new_frame(RF_FRAME_LEN, name, stack, ctx, state, Py_None, kind_rf, self);
    if (frame == NULL || (PyList_GET_SIZE(stack) < max_depth && PyList_Append(stack, frame) < 0))
        goto fail;
    PyObject *start = now();
    if (start == NULL || PyList_SetItem(frame, F_START, start) < 0)
        goto fail;
    opened = Py_NewRef(result);
fail:
    Py_DECREF(ctx);
    Py_XDECREF(name);
    Py_XDECREF(frame);
    Py_XDECREF(stack);
    Py_XDECREF(state);
    Py_DECREF(result);
    return opened;
}

/* `record_function.__exit__` as `bridge_exit(python_exit, original_exit, self, exc_type,
 * exc, tb)`: the range on top of this thread's stack, closed without an exception, is ended
 * and delivered here, then torch's own exit runs; every other case is the Python bridge's
 * exit (which runs torch's exit too). */
static PyObject *
bridge_exit(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (bound_call(nargs, 6,
                   "bridge_exit(python_exit, original_exit, self, exc_type, exc, tb)") < 0)
        return NULL;
    PyObject *const *call = args + 2; /* self, exc_type, exc, tb */
    PyObject *state = get_thread_state(0);
    if (state == NULL)
        return NULL;
    if (state == Py_None) { /* this thread never recorded: nothing of ours to close */
        Py_DECREF(state);
        return PyObject_Vectorcall(args[1], call, 4, NULL);
    }
    PyObject *stack = slot_get(SLOT(THREAD, stack), state);
    if (stack == NULL) {
        Py_DECREF(state);
        return NULL;
    }
    Py_ssize_t depth = PyList_Check(stack) ? PyList_GET_SIZE(stack) : 0;
    PyObject *frame = depth ? PyList_GET_ITEM(stack, depth - 1) : NULL;
    if (frame == NULL || !PyList_Check(frame) || PyList_GET_SIZE(frame) <= F_OWNER ||
        PyList_GET_ITEM(frame, F_OWNER) != call[0] || call[1] != Py_None) {
        /* not on top, or an exception: the Python exit */
        int mine = owns_a_frame(stack, call[0]);
        Py_DECREF(stack);
        Py_DECREF(state);
        return PyObject_Vectorcall(args[mine ? 0 : 1], call, 4, NULL);
    }
    PyObject *end = now(); /* before the range leaves the stack, as in the Python exit */
    if (end == NULL) {
        Py_DECREF(stack);
        Py_DECREF(state);
        return NULL;
    }
    Py_INCREF(frame);
    pop_top(stack, depth);
    Py_DECREF(stack);
    /* the frame lets torch free the range object now, not on the builder */
    int failed = PyList_SetItem(frame, F_END, end) < 0 ||
                 PyList_SetItem(frame, F_OWNER, Py_NewRef(Py_None)) < 0 ||
                 deliver(frame, state) < 0;
    Py_DECREF(frame);
    Py_DECREF(state);
    if (failed)
        return NULL;
    return PyObject_Vectorcall(args[1], call, 4, NULL);
}

/* ---- the step context: `Recorder.begin_step` ---- */

/* Every slot of a StepContext: a new one starts as a copy of the template (made by
 * StepContext.__init__ at bind(), so its defaults are the class's own), then gets its own
 * number, epoch, start, phase, range list and owner. */
#define MAX_CTX_SLOTS 32
static PyTypeObject *ctx_type; /* NULL: StepContext() stays Python */
static PyObject *ctx_template;
static Py_ssize_t ctx_offsets[MAX_CTX_SLOTS];
static Py_ssize_t ctx_slot_count;

static int
bind_step_context(PyObject *cls, PyObject *template)
{
    ctx_type = NULL;
    if (Py_TYPE(template) != (PyTypeObject *)cls)
        return 0;
    PyObject *names = PyObject_GetAttrString(cls, "__slots__");
    if (names == NULL)
        return -1;
    PyObject *seq = PySequence_Fast(names, "StepContext.__slots__");
    Py_DECREF(names);
    if (seq == NULL)
        return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    int ok = n <= MAX_CTX_SLOTS;
    for (Py_ssize_t i = 0; ok && i < n; i++) {
        Slot slot = {NULL, 0, PySequence_Fast_GET_ITEM(seq, i)};
        if (slot_init(&slot, cls) < 0) {
            Py_DECREF(seq);
            return -1;
        }
        ok = slot.type != NULL &&
             *(PyObject **)((char *)template + slot.offset) != NULL;
        ctx_offsets[i] = slot.offset;
    }
    Py_DECREF(seq);
    static const int used[] = {K_CTX_step,  K_CTX_epoch,  K_CTX_start_ns, K_CTX_trim_start,
                               K_CTX_phase, K_CTX_frames, K_CTX_owner};
    for (size_t i = 0; i < sizeof used / sizeof used[0]; i++)
        ok = ok && slots[used[i]].type == (PyTypeObject *)cls;
    if (!ok)
        return 0; /* not the layout this code knows: StepContext() stays Python */
    ctx_slot_count = n;
    Py_XSETREF(ctx_template, Py_NewRef(template));
    ctx_type = (PyTypeObject *)cls;
    return 0;
}

#define CTX_OFFSET(n) (slots[K_CTX_##n].offset)

/* `Recorder.begin_step(step, epoch, start_ns, trim_start, phase)`: a new StepContext,
 * recorded from now on. */
static PyObject *
begin_step(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (bound_call(nargs, 6, "begin_step(recorder, step, epoch, start_ns, trim_start, phase)") < 0)
        return NULL;
    if (args[0] != recorder || ctx_type == NULL)
        return PyObject_Vectorcall(py_begin_step, args, nargs, NULL);
    PyObject *frames = PyList_New(0);
    if (frames == NULL)
        return NULL;
    PyObject *state = get_thread_state(1);
    if (state == NULL) {
        Py_DECREF(frames);
        return NULL;
    }
    PyObject *ctx = ctx_type->tp_alloc(ctx_type, 0);
    if (ctx == NULL) {
        Py_DECREF(frames);
        Py_DECREF(state);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < ctx_slot_count; i++) {
        PyObject *value = *(PyObject **)((char *)ctx_template + ctx_offsets[i]);
        set_slot(ctx, ctx_offsets[i], Py_NewRef(value));
    }
    set_slot(ctx, CTX_OFFSET(step), Py_NewRef(args[1]));
    set_slot(ctx, CTX_OFFSET(epoch), Py_NewRef(args[2]));
    set_slot(ctx, CTX_OFFSET(start_ns), Py_NewRef(args[3]));
    set_slot(ctx, CTX_OFFSET(trim_start), Py_NewRef(args[4]));
    set_slot(ctx, CTX_OFFSET(phase), Py_NewRef(args[5]));
    set_slot(ctx, CTX_OFFSET(frames), frames);
    set_slot(ctx, CTX_OFFSET(owner), state);
    set_slot(recorder, SLOT(RECORDER, current)->offset, Py_NewRef(ctx));
    return ctx;
}

/* ---- a finished step sampled out on its thread (`OnThreadSampler.sample_out`) ---- */

static int
as_double(PyObject *value, double *out)
{
    *out = PyFloat_AsDouble(value);
    return (*out == -1.0 && PyErr_Occurred()) ? -1 : 0;
}

static int
as_ns(PyObject *value, long long *out)
{
    *out = PyLong_AsLongLong(value);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

/* A field of the sampler or of its limits, as a double or a long long (-1 on error). */
static int
double_of(Slot *slot, PyObject *obj, double *out)
{
    PyObject *value = slot_get(slot, obj);
    int failed = value == NULL || as_double(value, out) < 0;
    Py_XDECREF(value);
    return failed ? -1 : 0;
}

static int
ns_of(Slot *slot, PyObject *obj, long long *out)
{
    PyObject *value = slot_get(slot, obj);
    int failed = value == NULL || as_ns(value, out) < 0;
    Py_XDECREF(value);
    return failed ? -1 : 0;
}

static int
truthy_slot(Slot *slot, PyObject *obj)
{
    PyObject *value = slot_get(slot, obj);
    if (value == NULL)
        return -1;
    int yes = PyObject_IsTrue(value);
    Py_DECREF(value);
    return yes;
}

/* The layout `layout_of` found last, as the sampler's `layouts` holds it: a step nearly
 * always has the previous step's ranges, so comparing their names with it (by identity,
 * else equality) skips building and hashing a tuple of names and two dict lookups. Valid
 * only while `layouts[id]` is still this very entry (`reset()` clears them). */
static PyObject *last_layout; /* (phase, root, names), a strong reference, or NULL */
static long last_layout_id = -1;

static int
same_or_equal(PyObject *a, PyObject *b)
{
    if (a == b)
        return 1;
    int equal = PyObject_RichCompareBool(a, b, Py_EQ);
    if (equal < 0)
        PyErr_Clear();
    return equal > 0;
}

static long
last_layout_of(PyObject *layouts, PyObject *phase, PyObject *frames)
{
    if (last_layout == NULL || !same_or_equal(PyTuple_GET_ITEM(last_layout, 0), phase))
        return -1;
    PyObject *names = PyTuple_GET_ITEM(last_layout, 2);
    Py_ssize_t n = PyList_GET_SIZE(frames);
    if (!PyTuple_Check(names) || PyTuple_GET_SIZE(names) != n)
        return -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *frame = PyList_GET_ITEM(frames, i);
        if (!PyList_Check(frame) || PyList_GET_SIZE(frame) <= F_NAME ||
            !same_or_equal(PyList_GET_ITEM(frame, F_NAME), PyTuple_GET_ITEM(names, i)))
            return -1;
    }
    PyObject *key = PyLong_FromLong(last_layout_id);
    PyObject *entry = key == NULL ? NULL : PyObject_GetItem(layouts, key);
    Py_XDECREF(key);
    Py_XDECREF(entry); /* compared by identity only */
    if (entry != last_layout) {
        PyErr_Clear();
        return -1;
    }
    return last_layout_id;
}

static void
remember_layout(PyObject *layouts, long id)
{
    PyObject *key = PyLong_FromLong(id);
    PyObject *entry = key == NULL ? NULL : PyObject_GetItem(layouts, key);
    Py_XDECREF(key);
    if (entry == NULL || !PyTuple_Check(entry) || PyTuple_GET_SIZE(entry) != 3) {
        PyErr_Clear();
        Py_XDECREF(entry);
        return;
    }
    Py_XSETREF(last_layout, entry);
    last_layout_id = id;
}

/* The layout id of a step whose ranges closed in this name order, -1 when the table is
 * full (the step goes to the builder), -2 on error. */
static long
layout_of(PyObject *phase, PyObject *frames)
{
    PyObject *layouts = slot_get(SLOT(SAMPLER, layouts), sampler);
    if (layouts == NULL)
        return -2;
    long cached = last_layout_of(layouts, phase, frames);
    if (cached >= 0) {
        Py_DECREF(layouts);
        return cached;
    }
    long id = -2;
    PyObject *ids = NULL, *most = NULL;
    Py_ssize_t n = PyList_GET_SIZE(frames);
    PyObject *names = PyTuple_New(n);
    if (names == NULL)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *name = PySequence_GetItem(PyList_GET_ITEM(frames, i), F_NAME);
        if (name == NULL)
            goto done;
        PyTuple_SET_ITEM(names, i, name);
    }
    ids = slot_get(SLOT(SAMPLER, layout_ids), sampler);
    if (ids == NULL)
        goto done;
    PyObject *by_names = PyDict_GetItemWithError(ids, phase);
    if (by_names == NULL) {
        if (PyErr_Occurred())
            goto done;
        PyObject *fresh = PyDict_New();
        int failed = fresh == NULL || PyDict_SetItem(ids, phase, fresh) < 0;
        Py_XDECREF(fresh); /* the dict keeps it */
        if (failed)
            goto done;
        by_names = fresh;
    }
    PyObject *known = PyDict_GetItemWithError(by_names, names);
    if (known != NULL) {
        id = PyLong_AsLong(known);
        if (id == -1 && PyErr_Occurred())
            id = -2;
        else
            remember_layout(layouts, id);
        goto done;
    }
    if (PyErr_Occurred())
        goto done;
    most = slot_get(SLOT(SAMPLER, max_layouts), sampler);
    if (most == NULL)
        goto done;
    Py_ssize_t count = PyObject_Length(layouts);
    long limit = PyLong_AsLong(most);
    if (count < 0 || (limit == -1 && PyErr_Occurred()))
        goto done;
    if (count >= limit) {
        id = -1;
        goto done;
    }
    int is_train = PyObject_RichCompareBool(phase, phase_train, Py_EQ);
    if (is_train < 0)
        goto done;
    PyObject *key = PyLong_FromSsize_t(count);
    PyObject *entry = key == NULL ? NULL : PyTuple_Pack(3, phase, is_train ? step_span : phase, names);
    int failed = entry == NULL || PyObject_SetItem(layouts, key, entry) < 0 ||
                 PyDict_SetItem(by_names, names, key) < 0;
    Py_XDECREF(entry);
    Py_XDECREF(key);
    if (!failed) {
        id = (long)count;
        remember_layout(layouts, id);
    }
done:
    Py_XDECREF(most);
    Py_XDECREF(ids);
    Py_XDECREF(names);
    Py_DECREF(layouts);
    return id;
}

/* end - start as an int64 in `out`: 1, or 0 when either is not an int or the difference
 * overflows (the Python path then raises OverflowError or TypeError too), -1 on error */
static int
ns_difference(PyObject *start, PyObject *end, long long *out)
{
    if (!PyLong_Check(start) || !PyLong_Check(end))
        return 0;
    int over_start, over_end;
    long long s = PyLong_AsLongLongAndOverflow(start, &over_start);
    if (s == -1 && PyErr_Occurred())
        return -1;
    long long e = PyLong_AsLongLongAndOverflow(end, &over_end);
    if (e == -1 && PyErr_Occurred())
        return -1;
    return !over_start && !over_end && !__builtin_sub_overflow(e, s, out);
}

/* The thread's next `capture_steps` steps go to the builder too (0, or -1 on error). */
static int
hold_next_steps(PyObject *state)
{
    PyObject *capture = slot_get(SLOT(SAMPLER, capture_steps), sampler);
    return capture == NULL || slot_set(SLOT(THREAD, hold), state, capture) < 0 ? -1 : 0;
}

/* `OnThreadSampler.sample_out` (see there): 1 if the step was sampled out here, 0 if it
 * goes to the builder, -1 on error. */
static int
sample_out_impl(PyObject *ctx, PyObject *end_obj, PyObject *state)
{
    PyObject *mine = get_thread_state(0);
    if (mine == NULL)
        return -1;
    Py_DECREF(mine);
    if (mine != state) /* ended from another thread: the builder decides */
        return 0;
    long long end_ns, start_ns, long_ns;
    PyObject *start_obj = slot_get(SLOT(CTX, start_ns), ctx);
    if (start_obj == NULL)
        return -1;
    int bad = as_ns(start_obj, &start_ns) < 0 || as_ns(end_obj, &end_ns) < 0;
    Py_DECREF(start_obj);
    if (bad || ns_of(SLOT(SAMPLER, long_step_ns), sampler, &long_ns) < 0)
        return -1;
    long long duration = end_ns - start_ns;
    if (duration >= long_ns) /* long: the builder decides, and any anomaly's next steps */
        return hold_next_steps(state);
    PyObject *phase = slot_get(SLOT(CTX, phase), ctx);
    if (phase == NULL)
        return -1;
    int result = -1;
    PyObject *by_phase = NULL, *limits = NULL, *frames = NULL, *row = NULL;
    by_phase = slot_get(SLOT(SAMPLER, limits), sampler); /* held: the builder may publish anew */
    if (by_phase == NULL)
        goto done;
    limits = PyObject_GetItem(by_phase, phase);
    if (limits == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_KeyError))
            goto done;
        PyErr_Clear();
        result = 0;
        goto done;
    }
    double unknown, tail, slowest, anomaly;
    if (double_of(SLOT(LIMITS, first_unknown), limits, &unknown) < 0 ||
        double_of(SLOT(LIMITS, tail_tokens), limits, &tail) < 0 ||
        double_of(SLOT(LIMITS, slowest_ns), limits, &slowest) < 0 ||
        double_of(SLOT(LIMITS, anomaly_ns), limits, &anomaly) < 0)
        goto done;
    if ((double)duration >= anomaly) { /* maybe an anomaly: the next steps may be captured */
        result = hold_next_steps(state);
        goto done;
    }
    long long hold;
    if (ns_of(SLOT(THREAD, hold), state, &hold) < 0)
        goto done;
    if (hold) {
        result = slot_set(SLOT(THREAD, hold), state, PyLong_FromLongLong(hold - 1)) < 0 ? -1 : 0;
        goto done;
    }
    PyObject *kept = slot_get(SLOT(CTX, kept), ctx);
    if (kept == NULL)
        goto done;
    Py_DECREF(kept);
    if (kept != Py_None) {
        result = 0;
        goto done;
    }
    int yes = truthy_slot(SLOT(CTX, trim_start), ctx);
    if (yes == 0)
        yes = truthy_slot(SLOT(CTX, error), ctx);
    if (yes != 0) {
        result = yes < 0 ? -1 : 0;
        goto done;
    }
    frames = slot_get(SLOT(CTX, frames), ctx);
    if (frames == NULL)
        goto done;
    if (!PyList_Check(frames) || PyList_GET_SIZE(frames) == 0) {
        result = 0;
        goto done;
    }
    /* head sampling may keep it (the same steps on every rank): its number is selected,
     * or past what was published */
    PyObject *number = slot_get(SLOT(CTX, batch), ctx);
    if (number == Py_None) {
        Py_DECREF(number);
        number = slot_get(SLOT(CTX, step), ctx);
    }
    if (number == NULL)
        goto done;
    double at = PyFloat_Check(number) ? PyFloat_AS_DOUBLE(number) : PyLong_AsDouble(number);
    int head = at == -1.0 && PyErr_Occurred() ? -1 : at >= unknown;
    if (head == 0) {
        PyObject *selected = slot_get(SLOT(LIMITS, selected), limits);
        head = selected == NULL ? -1 : PySequence_Contains(selected, number);
        Py_XDECREF(selected);
    }
    Py_DECREF(number);
    if (head != 0) {
        result = head < 0 ? -1 : 0;
        goto done;
    }
    Py_ssize_t n = PyList_GET_SIZE(frames);
    Py_ssize_t spans = n + 1;
    if ((double)spans <= tail && (double)duration > slowest) { /* maybe the tail's */
        PyObject *left = PyFloat_FromDouble(tail - (double)spans);
        result = slot_set(SLOT(LIMITS, tail_tokens), limits, left) < 0 ? -1 : 0;
        goto done;
    }
    long layout = layout_of(phase, frames);
    if (layout < 0) {
        result = layout == -1 ? 0 : -1;
        goto done;
    }
    /* one bytes object of int64s (`_frames.pack_row`): no Python int per range, and no
     * container for the garbage collector to track while it waits for the builder */
    row = PyBytes_FromStringAndSize(NULL, (n + 2) * (Py_ssize_t)sizeof(int64_t));
    if (row == NULL)
        goto done;
    int64_t *values = (int64_t *)PyBytes_AS_STRING(row);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *frame = PyList_GET_ITEM(frames, i);
        long long took;
        int fits = ns_difference(PyList_GET_ITEM(frame, F_START), PyList_GET_ITEM(frame, F_END), &took);
        if (fits <= 0) { /* a clock that gives no int64 ns: the builder's */
            result = fits < 0 ? -1 : 0;
            goto done;
        }
        values[i] = took;
    }
    values[n] = duration;
    values[n + 1] = layout;
    PyObject *cuda = FIELD(cuda_timer);
    if (cuda == NULL)
        goto done;
    if (cuda != Py_None) { /* its CUDA events are reused by later ranges */
        for (Py_ssize_t i = 0; i < n; i++) {
            PyObject *events = PyList_GET_ITEM(PyList_GET_ITEM(frames, i), F_CUDA);
            if (events == Py_None)
                continue;
            PyObject *done = PyObject_CallMethodOneArg(cuda, NAME(OTHER, release), events);
            if (done == NULL)
                goto done;
            Py_DECREF(done);
        }
    }
    /* later ranges of it are queued singly and counted as sampled out; its ranges are
     * freed now, on this thread */
    if (slot_set(SLOT(CTX, owner), ctx, Py_NewRef(Py_None)) < 0 ||
        slot_set(SLOT(CTX, kept), ctx, Py_NewRef(Py_False)) < 0 ||
        PyList_SetSlice(frames, 0, n, NULL) < 0)
        goto done;
    PyObject *rows = slot_get(SLOT(THREAD, rows), state);
    if (rows == NULL)
        goto done;
    int failed = PyList_Append(rows, row) < 0;
    Py_ssize_t batched = PyList_Check(rows) ? PyList_GET_SIZE(rows) : 0;
    Py_DECREF(rows);
    long long most;
    if (failed || ns_of(SLOT(SAMPLER, rows_per_item), sampler, &most) < 0)
        goto done;
    if (batched >= most) {
        PyObject *args[2] = {sampler, state};
        PyObject *handed = PyObject_VectorcallMethod(NAME(SAMPLER, hand_rows), args, 2, NULL);
        if (handed == NULL)
            goto done;
        Py_DECREF(handed);
    }
    result = 1;
done:
    Py_XDECREF(row);
    Py_XDECREF(frames);
    Py_XDECREF(limits);
    Py_XDECREF(by_phase);
    Py_DECREF(phase);
    return result;
}

/* ---- a finished step queued whole (`Recorder.emit_step`) ---- */

/* `Recorder._queue_item(item, carried)` while the queue stays below half its capacity (no
 * builder to wake, nothing dropped); every other case is the Python method's. */
static int
queue_item(PyObject *item, Py_ssize_t carried)
{
    PyObject *queue = FIELD(queue);
    PyObject *capacity = queue == NULL ? NULL : FIELD(capacity);
    PyObject *in_obj = capacity == NULL ? NULL : FIELD(in_items);
    PyObject *out_obj = in_obj == NULL ? NULL : FIELD(out_items);
    if (out_obj == NULL)
        return -1;
    Py_ssize_t length = PyObject_Length(queue);
    Py_ssize_t room = PyLong_AsSsize_t(capacity);
    Py_ssize_t in = PyLong_AsSsize_t(in_obj), out = PyLong_AsSsize_t(out_obj);
    if (length < 0 || PyErr_Occurred())
        return -1;
    Py_ssize_t queued = length + (in - out);
    if (2 * (queued + carried) < room) {
        PyObject *more = PyLong_FromSsize_t(in + carried);
        if (more == NULL)
            return -1;
        set_slot(recorder, SLOT(RECORDER, in_items)->offset, more);
        PyObject *done = PyObject_CallMethodOneArg(queue, NAME(OTHER, append), item);
        Py_XDECREF(done);
        return done == NULL ? -1 : 0;
    }
    PyObject *count = PyLong_FromSsize_t(carried);
    PyObject *args[3] = {recorder, item, count};
    PyObject *done = count == NULL ? NULL
                                   : PyObject_VectorcallMethod(NAME(RECORDER, _queue_item), args, 3, NULL);
    Py_XDECREF(count);
    Py_XDECREF(done);
    return done == NULL ? -1 : 0;
}

/* `Recorder.emit_step(ctx, end)` (see there). `owner` is the context's owner as it was
 * read (its slot is cleared here). */
static int
emit_step(PyObject *ctx, PyObject *end, PyObject *owner)
{
    PyObject *mine = get_thread_state(1);
    if (mine == NULL)
        return -1;
    int result = -1;
    PyObject *phase = NULL, *attrs = NULL, *start = NULL, *frames = NULL, *item = NULL;
    phase = slot_get(SLOT(CTX, phase), ctx);
    attrs = phase == NULL ? NULL : slot_get(SLOT(CTX, attrs), ctx);
    start = attrs == NULL ? NULL : slot_get(SLOT(CTX, start_ns), ctx);
    frames = start == NULL ? NULL : slot_get(SLOT(CTX, frames), ctx);
    if (frames == NULL)
        goto done;
    Py_ssize_t carried = PyObject_Length(frames);
    int is_train = carried < 0 ? -1 : PyObject_RichCompareBool(phase, phase_train, Py_EQ);
    if (is_train < 0 || slot_set(SLOT(CTX, owner), ctx, Py_NewRef(Py_None)) < 0)
        goto done;
    item = PyList_New(FRAME_LEN);
    if (item == NULL)
        goto done;
    PyObject *elsewhere = owner != Py_None && owner != mine ? Py_True : Py_False;
    PyObject *fields[FRAME_LEN] = {is_train ? step_span : phase, zero, zero, ctx, mine, attrs,
                                   start, end, Py_None, Py_None, kind_step, Py_None, elsewhere};
    for (Py_ssize_t i = 0; i < FRAME_LEN; i++)
        PyList_SET_ITEM(item, i, Py_NewRef(fields[i]));
    result = queue_item(item, carried);
done:
    Py_XDECREF(item);
    Py_XDECREF(frames);
    Py_XDECREF(start);
    Py_XDECREF(attrs);
    Py_XDECREF(phase);
    Py_DECREF(mine);
    return result;
}

/* `Recorder.end_step(ctx, end_ns)`: nothing records; the step is sampled out on its thread
 * or queued whole. Returns the thread state it ran on (its owner as it was). */
static PyObject *
end_step(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (bound_call(nargs, 3, "end_step(recorder, ctx, end_ns)") < 0)
        return NULL;
    if (args[0] != recorder)
        return PyObject_Vectorcall(py_end_step, args, nargs, NULL);
    PyObject *ctx = args[1], *end = args[2];
    set_slot(recorder, SLOT(RECORDER, current)->offset, Py_NewRef(Py_None));
    PyObject *state = slot_get(SLOT(CTX, owner), ctx);
    if (state == NULL)
        return NULL;
    int out = state == Py_None ? 0 : sample_out_impl(ctx, end, state);
    if (out == 0)
        out = emit_step(ctx, end, state);
    if (out < 0) {
        Py_DECREF(state);
        return NULL;
    }
    return state;
}

/* ---- binding ---- */

static void
keep(PyObject **slot, PyObject *value)
{
    Py_XSETREF(*slot, Py_NewRef(value));
}

/* bind(recorder, sampler, classes, template, python, constants): see
 * `_recorder.use_compiled`, which is its only caller. */
static PyObject *
bind(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    static const char *usage =
        "bind(recorder, sampler, (Recorder, OnThreadSampler, Timing, ThreadState, "
        "StepContext, QuietLimits, _Local), template, (timing_exit, begin_step, end_step, "
        "thread_state, torch_range_enter), (KIND_TIMING, KIND_RF, KIND_STEP, MAX_DEPTH, "
        "PHASE_TRAIN, STEP_SPAN))";
    if (nargs != 6 || !PyTuple_Check(args[2]) || PyTuple_GET_SIZE(args[2]) != C_COUNT ||
        !PyTuple_Check(args[4]) || PyTuple_GET_SIZE(args[4]) != 5 || !PyTuple_Check(args[5]) ||
        PyTuple_GET_SIZE(args[5]) != 6) {
        PyErr_Format(PyExc_TypeError, "otelprof._speedups: %s", usage);
        return NULL;
    }
    PyObject *classes = args[2], *template = args[3], *python = args[4], *constants = args[5];
    for (int c = 0; c < C_COUNT; c++) {
        if (!PyType_Check(PyTuple_GET_ITEM(classes, c))) {
            PyErr_Format(PyExc_TypeError, "bind(): %s is not a class", class_names[c]);
            return NULL;
        }
    }
    static const int bound_class[] = {
#define CLASS(c, n) C_##c,
        BOUND(CLASS)
#undef CLASS
    };
    for (int k = 0; k < K_COUNT; k++) {
        if (bound_class[k] == C_OTHER)
            continue; /* names of what the recorder holds: looked up as usual */
        if (slot_init(&slots[k], PyTuple_GET_ITEM(classes, bound_class[k])) < 0)
            return NULL;
        if (bound_class[k] == C_RECORDER && slots[k].type == NULL &&
            k != K_RECORDER_hand_off && k != K_RECORDER_count_drop && k != K_RECORDER__queue_item) {
            PyErr_Format(PyExc_TypeError, "bind(): Recorder.%U is not a __slots__ field",
                         slots[k].name);
            return NULL;
        }
    }
    PyObject *rec = args[0];
    if (Py_TYPE(rec) != (PyTypeObject *)PyTuple_GET_ITEM(classes, C_RECORDER)) {
        PyErr_SetString(PyExc_TypeError, "bind(): the recorder is no Recorder");
        return NULL;
    }
    Py_ssize_t depth = PyLong_AsSsize_t(PyTuple_GET_ITEM(constants, 3));
    if (depth == -1 && PyErr_Occurred())
        return NULL;
    if (bind_step_context(PyTuple_GET_ITEM(classes, C_CTX), template) < 0)
        return NULL;
    keep(&recorder, rec);
    keep(&sampler, args[1]);
    keep(&py_timing_exit, PyTuple_GET_ITEM(python, 0));
    keep(&py_begin_step, PyTuple_GET_ITEM(python, 1));
    keep(&py_end_step, PyTuple_GET_ITEM(python, 2));
    keep(&make_thread_state, PyTuple_GET_ITEM(python, 3));
    keep(&torch_range_enter, PyTuple_GET_ITEM(python, 4));
    keep(&kind_timing, PyTuple_GET_ITEM(constants, 0));
    keep(&kind_rf, PyTuple_GET_ITEM(constants, 1));
    keep(&kind_step, PyTuple_GET_ITEM(constants, 2));
    keep(&phase_train, PyTuple_GET_ITEM(constants, 4));
    keep(&step_span, PyTuple_GET_ITEM(constants, 5));
    max_depth = depth;
    Py_CLEAR(last_state); /* every thread asks again */
    Py_CLEAR(last_threads);
    last_thread_id = 0;
    Py_CLEAR(last_layout);
    last_layout_id = -1;
    Py_RETURN_NONE;
}

static PyObject *
method(PyObject *module, PyObject *function)
{
    return PyInstanceMethod_New(function);
}

static PyMethodDef methods[] = {
    {"bind", (PyCFunction)(void (*)(void))bind, METH_FASTCALL,
     "bind the recorder's objects (`_recorder.use_compiled`)"},
    {"method", method, METH_O, "method(function): a class attribute that binds like a def"},
    {"timing_enter", timing_enter, METH_O, "Timing.__enter__"},
    {"timing_exit", (PyCFunction)(void (*)(void))timing_exit, METH_FASTCALL, "Timing.__exit__"},
    {"bridge_enter", (PyCFunction)(void (*)(void))bridge_enter, METH_FASTCALL,
     "record_function.__enter__ bridged: bridge_enter(original_enter, self)"},
    {"bridge_exit", (PyCFunction)(void (*)(void))bridge_exit, METH_FASTCALL,
     "record_function.__exit__ bridged: bridge_exit(python_exit, original_exit, self, ...)"},
    {"begin_step", (PyCFunction)(void (*)(void))begin_step, METH_FASTCALL,
     "Recorder.begin_step(self, step, epoch, start_ns, trim_start, phase)"},
    {"end_step", (PyCFunction)(void (*)(void))end_step, METH_FASTCALL,
     "Recorder.end_step(self, ctx, end_ns)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef speedups = {
    PyModuleDef_HEAD_INIT, "otelprof._timings._speedups",
    "The recorder's hot path in C (see _speedups.c).", -1, methods, NULL, NULL, NULL, NULL,
};

/* BINDINGS: {class name ("" for the others'): (attribute, ...)} of every name this module
 * reads or calls. */
static PyObject *
bindings(void)
{
    static const int bound_class[] = {
#define CLASS(c, n) C_##c,
        BOUND(CLASS)
#undef CLASS
    };
    PyObject *table = PyDict_New();
    for (int k = 0; table != NULL && k < K_COUNT; k++) {
        const char *cls = bound_class[k] == C_OTHER ? "" : class_names[bound_class[k]];
        PyObject *names = PyDict_GetItemString(table, cls); /* borrowed */
        PyObject *more = names == NULL ? PyTuple_Pack(1, slots[k].name) : NULL;
        if (names != NULL) {
            PyObject *one = PyTuple_Pack(1, slots[k].name);
            more = one == NULL ? NULL : PySequence_Concat(names, one);
            Py_XDECREF(one);
        }
        if (more == NULL || PyDict_SetItemString(table, cls, more) < 0)
            Py_CLEAR(table);
        Py_XDECREF(more);
    }
    return table;
}

PyMODINIT_FUNC
PyInit__speedups(void)
{
    static const char *names[] = {
#define NAME_OF(c, n) #n,
        BOUND(NAME_OF)
#undef NAME_OF
    };
    for (int k = 0; k < K_COUNT; k++) {
        if ((slots[k].name = PyUnicode_InternFromString(names[k])) == NULL)
            return NULL;
    }
    zero = PyLong_FromLong(0);
    PyObject *time = PyImport_ImportModule("time");
    real_clock = time == NULL ? NULL : PyObject_GetAttrString(time, "perf_counter_ns");
    Py_XDECREF(time);
    if (zero == NULL || real_clock == NULL)
        return NULL;
    PyObject *module = PyModule_Create(&speedups);
    if (module == NULL)
        return NULL;
    PyObject *layout = Py_BuildValue(
        "{sisisisisisisisisisisisisisisi}", "F_NAME", F_NAME, "F_SPAN", F_SPAN, "F_PARENT",
        F_PARENT, "F_CTX", F_CTX, "F_THREAD", F_THREAD, "F_ATTRS", F_ATTRS, "F_START", F_START,
        "F_END", F_END, "F_ERROR", F_ERROR, "F_CUDA", F_CUDA, "F_KIND", F_KIND, "F_OWNER", F_OWNER,
        "F_RANGE", F_RANGE, "RF_LEN", RF_FRAME_LEN, "TIMING_LEN", FRAME_LEN);
    PyObject *table = bindings();
    if (layout == NULL || table == NULL || PyModule_AddObject(module, "FRAME_LAYOUT", layout) < 0 ||
        PyModule_AddObject(module, "BINDINGS", table) < 0 ||
        PyModule_AddStringConstant(module, "CPYTHON_CHECKED", OTELPROF_CPYTHON_CHECKED) < 0 ||
        PyModule_AddIntConstant(module, "VERSION_TAGS", COMPAT_VERSION_TAGS) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
