/* The training thread's hot path in C: `Timing.__enter__`/`__exit__`, the record_function
 * bridge's `__enter__`/`__exit__`, `StepContext()`, the on-thread sampling decision at
 * `step()` (`_quiet_steps.sample_out`), the step item queued when a step goes to the builder
 * whole (`Recorder.emit_step`), the engine's common `step()` itself (`TimingsEngine.step`)
 * and `timed_items`' iterator.
 *
 * (`timing()` itself stays Python: torch.compile traces it, and steps aside in compiled code.)
 *
 * Why: at 0.3 ms steps the pure-Python versions of these few functions are most of what
 * profiling costs the training thread (about 1 us per range and 2-4 us per step on a slow
 * core). This module does exactly what the Python code in `_recorder.py` and
 * `_quiet_steps.py` does, building the same frame lists (`_frames.py`), reading the same
 * recorder fields (`_recorder.recorder`, by offset) and module globals (so the engine, tests
 * and monkeypatching see one state), and hands every uncommon case
 * (an exception, a frame not on top of the stack, CUDA events, a torch profiler range, an
 * unseen name) to the Python implementation. Those stay the reference: both paths run the
 * same tests (tests/test_compiled_hot_path.py).
 */
#include "_cpython_compat.h" /* CPython's private/unstable parts: only there */
#include <string.h>
#include <time.h>

/* frame layout: _frames.F_* (exported as FRAME_LAYOUT; _recorder uses this module only when
 * it equals _frames.LAYOUT) */
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
#define FRAME_LEN 13 /* _frames.TIMING_LEN */
#define RF_FRAME_LEN 12 /* _frames.RF_LEN: no F_RANGE, the range is torch's own */

static PyObject *rec_globals;   /* _recorder's module dict (bind()) */
static PyObject *recorder;      /* _recorder.recorder (bind()): its fields are read by offset */
static PyObject *quiet_globals; /* _quiet_steps's module dict (bind_quiet()) */
static PyObject *engine_globals; /* _engine's module dict (bind_engine()) */
static PyObject *api_globals; /* _api's module dict (bind_api()) */
static PyObject *zero;
static PyObject *real_clock; /* time.perf_counter_ns */

#define STRINGS(X)                                                                         \
    X(current) X(_local) X(state) X(stack) X(thread_state) X(name) X(attributes)          \
    X(KIND_TIMING) X(torch_profiler_state) X(_is_profiler_enabled) X(_torch_range_enter) \
    X(cuda_timer) X(enter) X(perf_counter_ns) X(_py_timing_exit) X(owner) X(frames)      \
    X(chunk_size) X(hand_off) X(queue) X(capacity) X(_count_drop) X(append)              \
    X(phase) X(quiet) X(start_ns) X(hold) X(kept) X(trim_start) X(error)                 \
    X(_layout_ids) X(layouts) X(MAX_LAYOUTS) X(CAPTURE_STEPS) X(ROWS_PER_ITEM) X(rows)   \
    X(hand_rows) X(release) X(STEP_SPAN) X(PHASE_TRAIN) X(Timing) X(ThreadState) X(StepContext) \
    X(KIND_RF) X(MAX_DEPTH) X(count_drop) X(batch) X(step) X(_running) X(_ctx) X(_stepping)     \
    X(_phase) X(_step_listeners) X(_train_acc_ns) X(_train_t0) X(_step) X(_batch_in_epoch)      \
    X(_step_from_start) X(_kineto) X(_schedule) X(_step_start) X(_epoch) X(_py_emit_step)         \
    X(_py_step) X(step_failed) X(sample_out) X(new_step_context) X(TimingsEngine)       \
    X(compiled) X(cancel) X(__enter__) X(__exit__) X(_active) X(_owner) X(_current)        \
    X(timings) X(to) X(detach) X(cpu) X(_timings_by_name) X(_TRAIN_BATCH) X(_REDUCE_METRICS) \
    X(_TO_DEVICE) X(_FROM_DEVICE) X(_tensor_class) X(_NoTensor) X(_nested_to_device)       \
    X(_nested_to_host) X(timing) X(train_batch) X(reduce_metrics) X(to_device)             \
    X(from_device) X(non_blocking) X(LONG_STEP_NS) X(KIND_STEP) X(attrs)     \
    X(_queue_item) X(in_items) X(out_items)

#define ENUM(n) K_##n,
enum { STRINGS(ENUM) K_COUNT };
#undef ENUM
static PyObject *strings[K_COUNT]; /* interned */
#define S(n) strings[K_##n]

/* Module globals are read many times per range. A dict's version tag changes whenever the
 * dict does, so a value looked up at the dict's current version is still its value (where
 * CPython has version tags: _cpython_compat.h; elsewhere it is looked up every time). */

typedef struct {
    PyObject *value; /* borrowed, like PyDict_GetItem's */
    uint64_t at;     /* beside its value: one cache line to read, not two */
} Cached;

typedef struct {
    Cached entries[K_COUNT];
} Cache;

static Cache rec_cache, quiet_cache, engine_cache, api_cache;

/* A module global (borrowed); NULL with an error set when it is missing. */
static PyObject *
global(PyObject *globals, Cache *cache, int key)
{
    uint64_t version = compat_dict_version(globals);
    Cached *entry = &cache->entries[key];
    if (COMPAT_VERSION_TAGS && version != 0 && entry->at == version)
        return entry->value;
    PyObject *value = PyDict_GetItemWithError(globals, strings[key]);
    if (value == NULL) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_RuntimeError, "otelprof._speedups: %U is not bound", strings[key]);
        return NULL;
    }
    entry->value = value;
    entry->at = version;
    return value;
}

#define REC(n) global(rec_globals, &rec_cache, K_##n)

/* The recorder's state (a `Recorder`, whose __slots__ bind() found): read in place, no
 * lookup at all. Borrowed, like REC(); NULL with an error set when the field is unset. */
static Py_ssize_t field_offsets[K_COUNT];

static PyObject *
field(int key)
{
    PyObject *value = *(PyObject **)((char *)recorder + field_offsets[key]);
    if (value == NULL)
        PyErr_Format(PyExc_AttributeError, "otelprof._speedups: recorder.%U is unset", strings[key]);
    return value;
}

#define FIELD(n) field(K_##n)
#define RECORDER_FIELDS(X)                                                                 \
    X(current) X(queue) X(capacity) X(chunk_size) X(cuda_timer) X(torch_profiler_state)   \
    X(in_items) X(out_items)
#define QUIET(n) global(quiet_globals, &quiet_cache, K_##n)
#define ENGINE(n) global(engine_globals, &engine_cache, K_##n)
#define API(n) global(api_globals, &api_cache, K_##n)

static int
check_bound(void)
{
    if (rec_globals == NULL) {
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

/* An attribute kept in a __slots__ slot, read in place when the object is exactly of the
 * class bind() saw (no descriptor call), else looked up as usual. */
typedef struct {
    PyTypeObject *type;
    Py_ssize_t offset;
    PyObject *name;
} Slot;

static Slot timing_name, timing_attributes, state_stack, state_hold, state_rows;
static Slot ctx_owner, ctx_frames, ctx_phase, ctx_start, ctx_kept, ctx_trim_start, ctx_error,
    ctx_batch, ctx_step, ctx_attrs;

static int
slot_init(Slot *slot, PyObject *cls, PyObject *name)
{
    slot->type = NULL;
    slot->offset = 0;
    slot->name = name;
    PyObject *descr = PyObject_GetAttr(cls, name);
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

/* perf_counter_ns() as the recorder sees it (a test may replace it). On Linux it is
 * clock_gettime(CLOCK_MONOTONIC), read here without the call. */
static PyObject *
now_from(PyObject *clock)
{
    if (clock == NULL)
        return NULL;
#ifdef __linux__
    struct timespec ts;
    if (clock == real_clock && clock_gettime(CLOCK_MONOTONIC, &ts) == 0)
        return PyLong_FromLongLong((long long)ts.tv_sec * 1000000000LL + ts.tv_nsec);
#endif
    return PyObject_CallNoArgs(clock);
}

static PyObject *
now(void)
{
    return now_from(REC(perf_counter_ns));
}

/* The thread that asked last, by its thread state's id (unique for the interpreter's life),
 * and the `_local` its state came from (a test may replace `_local`): the training thread
 * asks for nearly every range. Strong references. */
static uint64_t last_thread_id;
static PyObject *last_local, *last_state;

/* The calling thread's ThreadState (new reference), None if it has none and `make` is 0.
 * `_local.state` costs a thread-local lookup and a generic attribute lookup, so the last
 * thread's is kept at hand. */
static PyObject *
get_thread_state(int make)
{
    PyObject *local = REC(_local);
    if (local == NULL)
        return NULL;
    uint64_t id = compat_thread_id();
    if (id == last_thread_id && local == last_local && last_state != NULL)
        return Py_NewRef(last_state);
    PyObject *state = PyObject_GetAttr(local, S(state));
    if (state == NULL)
        return NULL;
    if (state == Py_None) {
        if (!make)
            return state;
        Py_DECREF(state);
        PyObject *maker = REC(thread_state);
        state = maker == NULL ? NULL : PyObject_CallNoArgs(maker);
        if (state == NULL)
            return NULL;
    }
    last_thread_id = id;
    Py_XSETREF(last_local, Py_NewRef(local));
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

/* Whether a torch profiler records now (1, 0; -1 on error): `profiler._is_profiler_enabled`.
 * Every timing asks; when `profiler` is a module (torch.autograd.profiler) the flag is read
 * from its dict at the dict's version, like the recorder's globals, with no attribute lookup
 * (a profiler session that sets the flag changes the version). */
static PyObject *profiler_dict; /* the dict `profiler_cache` holds values of (strong) */
static Cache profiler_cache;

static int
torch_profiler_on(PyObject *profiler)
{
    if (PyModule_CheckExact(profiler)) {
        PyObject *dict = PyModule_GetDict(profiler);
        if (dict != profiler_dict) {
            Py_XSETREF(profiler_dict, Py_NewRef(dict));
            memset(&profiler_cache, 0, sizeof profiler_cache);
        }
        PyObject *flag = global(dict, &profiler_cache, K__is_profiler_enabled);
        if (flag == Py_False || flag == Py_True)
            return flag == Py_True;
        if (flag != NULL)
            return PyObject_IsTrue(flag);
        PyErr_Clear(); /* not a plain global (a module __getattr__?): looked up below */
    }
    PyObject *enabled = PyObject_GetAttr(profiler, S(_is_profiler_enabled));
    if (enabled == NULL)
        return -1;
    int on = PyObject_IsTrue(enabled);
    Py_DECREF(enabled);
    return on;
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
    stack = slot_get(&state_stack, state);
    if (stack == NULL)
        goto fail;
    if (!PyList_Check(stack) || PyList_GET_SIZE(stack) == 0) {
        PyErr_SetString(PyExc_RuntimeError, "otelprof._speedups: a thread's stack lost its base");
        goto fail;
    }
    name = slot_get(&timing_name, self);
    if (name == NULL)
        goto fail;
    PyObject *attributes = slot_get(&timing_attributes, self);
    if (attributes == NULL)
        goto fail;
    PyObject *kind = REC(KIND_TIMING);
    if (kind != NULL)
        frame = new_frame(FRAME_LEN, name, stack, ctx, state, attributes, kind, self);
    Py_DECREF(attributes);
    if (frame == NULL || PyList_Append(stack, frame) < 0)
        goto fail;

    PyObject *profiler = FIELD(torch_profiler_state);
    if (profiler == NULL)
        goto fail;
    if (profiler != Py_None) {
        int on = torch_profiler_on(profiler);
        if (on < 0)
            goto fail;
        if (on) {
            PyObject *open = REC(_torch_range_enter);
            PyObject *range = open == NULL ? NULL : PyObject_CallOneArg(open, name);
            if (range == NULL || PyList_SetItem(frame, F_RANGE, range) < 0)
                goto fail;
        }
    }
    PyObject *cuda = FIELD(cuda_timer);
    if (cuda == NULL)
        goto fail;
    if (cuda != Py_None) {
        PyObject *events = PyObject_CallMethodNoArgs(cuda, S(enter));
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

/* Call `recorder.<key>(arg)` (no argument when `arg` is NULL) and drop the result. */
static int
call_recorder(int key, PyObject *arg)
{
    PyObject *args[2] = {recorder, arg};
    PyObject *result = PyObject_VectorcallMethod(strings[key], args, arg == NULL ? 1 : 2, NULL);
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
    PyObject *owner = slot_get(&ctx_owner, ctx);
    if (owner == NULL)
        return -1;
    int own = owner == state;
    Py_DECREF(owner);
    if (own) {
        PyObject *frames = slot_get(&ctx_frames, ctx);
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
            return call_recorder(K_hand_off, ctx);
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
        PyObject *done = PyObject_CallMethodOneArg(queue, S(append), frame);
        Py_XDECREF(done);
        return done == NULL ? -1 : 0;
    }
    return call_recorder(K_count_drop, NULL);
}

/* Whether a frame on `stack` was opened by `owner`. A range with none (forgotten by
 * `forget_ranges_above`, closed twice, or opened while nothing recorded) has nothing to
 * close: the Python exits return at once for it, so the compiled ones do not call them. */
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
 * `del stack[-1]` does, without a slice deletion's generic path. The list keeps its
 * allocation, as CPython's own pop does while it stays over half full. */
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
    PyObject *stack = slot_get(&state_stack, state);
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
        PyObject *slow = REC(_py_timing_exit);
        return slow == NULL ? NULL : PyObject_Vectorcall(slow, args, 4, NULL);
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
    stack = state == NULL ? NULL : slot_get(&state_stack, state);
    if (stack == NULL)
        goto fail;
    if (!PyList_Check(stack)) {
        PyErr_SetString(PyExc_RuntimeError, "otelprof._speedups: a thread's stack is no list");
        goto fail;
    }
    name = PyObject_GetAttr(self, S(name));
    PyObject *kind = name == NULL ? NULL : REC(KIND_RF);
    PyObject *max_depth = kind == NULL ? NULL : REC(MAX_DEPTH);
    if (max_depth == NULL)
        goto fail;
    Py_ssize_t limit = PyLong_AsSsize_t(max_depth);
    if (limit == -1 && PyErr_Occurred())
        goto fail;
    frame = new_frame(RF_FRAME_LEN, name, stack, ctx, state, Py_None, kind, self);
    if (frame == NULL || (PyList_GET_SIZE(stack) < limit && PyList_Append(stack, frame) < 0))
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
    PyObject *stack = slot_get(&state_stack, state);
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

/* ---- _quiet_steps.sample_out ---- */

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

/* Spend `spans` tokens of limits[index] (a float): what `limits[i] -= spans` does. */
static int
spend(PyObject *limits, Py_ssize_t index, double have, Py_ssize_t spans)
{
    PyObject *left = PyFloat_FromDouble(have - (double)spans);
    return left == NULL ? -1 : PyList_SetItem(limits, index, left);
}

/* The layout id of a step whose ranges closed in this name order, -1 when the table is
 * full (the step goes to the builder), -2 on error. */
/* The layout `layout_of` found last, as `layouts` holds it: a step nearly always has the
 * previous step's ranges, so comparing their names with it (by identity, else equality)
 * skips building and hashing a tuple of names and two dict lookups. Valid only while
 * `layouts[id]` is still this very entry (`_quiet_steps.reset()` clears them). */
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
last_layout_of(PyObject *phase, PyObject *frames)
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
    PyObject *layouts = QUIET(layouts);
    PyObject *key = layouts == NULL ? NULL : PyLong_FromLong(last_layout_id);
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

static long
layout_of(PyObject *phase, PyObject *frames)
{
    long cached = last_layout_of(phase, frames);
    if (cached >= 0)
        return cached;
    Py_ssize_t n = PyList_GET_SIZE(frames);
    PyObject *names = PyTuple_New(n);
    if (names == NULL)
        return -2;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *frame = PyList_GET_ITEM(frames, i);
        PyObject *name = PySequence_GetItem(frame, F_NAME);
        if (name == NULL) {
            Py_DECREF(names);
            return -2;
        }
        PyTuple_SET_ITEM(names, i, name);
    }
    long id = -2;
    PyObject *ids = QUIET(_layout_ids);
    PyObject *layouts = ids == NULL ? NULL : QUIET(layouts);
    if (layouts == NULL)
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
    PyObject *most = QUIET(MAX_LAYOUTS);
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
    PyObject *train = REC(PHASE_TRAIN);
    PyObject *root = NULL;
    if (train == NULL)
        goto done;
    int is_train = PyObject_RichCompareBool(phase, train, Py_EQ);
    if (is_train < 0)
        goto done;
    root = is_train ? REC(STEP_SPAN) : phase;
    if (root == NULL)
        goto done;
    PyObject *key = PyLong_FromSsize_t(count);
    PyObject *entry = key == NULL ? NULL : PyTuple_Pack(3, phase, root, names);
    int failed = entry == NULL || PyObject_SetItem(layouts, key, entry) < 0 ||
                 PyDict_SetItem(by_names, names, key) < 0;
    Py_XDECREF(entry);
    Py_XDECREF(key);
    if (!failed) {
        id = (long)count;
        remember_layout(layouts, id);
    }
done:
    Py_DECREF(names);
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

/* The thread's next `CAPTURE_STEPS` steps go to the builder too (0, or -1 on error). */
static int
hold_next_steps(PyObject *state)
{
    PyObject *capture = QUIET(CAPTURE_STEPS);
    return capture == NULL || slot_set(&state_hold, state, Py_NewRef(capture)) < 0 ? -1 : 0;
}

/* `_quiet_steps.sample_out` (see there): 1 if the step was sampled out here, 0 if it goes to
 * the builder, -1 on error. */
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
    PyObject *start_obj = slot_get(&ctx_start, ctx);
    if (start_obj == NULL)
        return -1;
    int bad = as_ns(start_obj, &start_ns) < 0 || as_ns(end_obj, &end_ns) < 0;
    Py_DECREF(start_obj);
    PyObject *long_obj = bad ? NULL : QUIET(LONG_STEP_NS);
    if (long_obj == NULL || as_ns(long_obj, &long_ns) < 0)
        return -1;
    long long duration = end_ns - start_ns;
    if (duration >= long_ns) /* long: the builder decides, and any anomaly's next steps */
        return hold_next_steps(state);
    PyObject *phase = slot_get(&ctx_phase, ctx);
    if (phase == NULL)
        return -1;
    int result = -1;
    PyObject *limits = NULL, *frames = NULL, *row = NULL;
    PyObject *quiet = QUIET(quiet);
    if (quiet == NULL)
        goto done;
    limits = PyObject_GetItem(quiet, phase); /* held: the builder may publish a new dict */
    if (limits == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_KeyError))
            goto done;
        PyErr_Clear();
        result = 0;
        goto done;
    }
    if (!PyList_Check(limits) || PyList_GET_SIZE(limits) < 5) {
        PyErr_SetString(PyExc_TypeError, "otelprof._speedups: quiet limits must be a list of 5");
        goto done;
    }
    double unknown, tail, slowest, anomaly;
    if (as_double(PyList_GET_ITEM(limits, 0), &unknown) < 0 ||
        as_double(PyList_GET_ITEM(limits, 1), &tail) < 0 ||
        as_double(PyList_GET_ITEM(limits, 2), &slowest) < 0 ||
        as_double(PyList_GET_ITEM(limits, 3), &anomaly) < 0)
        goto done;
    if ((double)duration >= anomaly) { /* maybe an anomaly: the next steps may be captured */
        result = hold_next_steps(state);
        goto done;
    }
    PyObject *hold_obj = slot_get(&state_hold, state);
    if (hold_obj == NULL)
        goto done;
    long hold = PyLong_AsLong(hold_obj);
    Py_DECREF(hold_obj);
    if (hold == -1 && PyErr_Occurred())
        goto done;
    if (hold) {
        result = slot_set(&state_hold, state, PyLong_FromLong(hold - 1)) < 0 ? -1 : 0;
        goto done;
    }
    PyObject *kept = slot_get(&ctx_kept, ctx);
    if (kept == NULL)
        goto done;
    Py_DECREF(kept);
    if (kept != Py_None) {
        result = 0;
        goto done;
    }
    int yes = truthy_slot(&ctx_trim_start, ctx);
    if (yes == 0)
        yes = truthy_slot(&ctx_error, ctx);
    if (yes != 0) {
        result = yes < 0 ? -1 : 0;
        goto done;
    }
    frames = slot_get(&ctx_frames, ctx);
    if (frames == NULL)
        goto done;
    if (!PyList_Check(frames) || PyList_GET_SIZE(frames) == 0) {
        result = 0;
        goto done;
    }
    /* head sampling may keep it (the same steps on every rank): its number is selected,
     * or past what was published */
    PyObject *number = slot_get(&ctx_batch, ctx);
    if (number == Py_None) {
        Py_DECREF(number);
        number = slot_get(&ctx_step, ctx);
    }
    if (number == NULL)
        goto done;
    double at = PyFloat_Check(number) ? PyFloat_AS_DOUBLE(number) : PyLong_AsDouble(number);
    int head = at == -1.0 && PyErr_Occurred() ? -1 : at >= unknown;
    if (head == 0) {
        PyObject *selected = PyList_GET_ITEM(limits, 4);
        head = PyAnySet_Check(selected) ? PySet_Contains(selected, number)
                                        : PySequence_Contains(selected, number);
    }
    Py_DECREF(number);
    if (head != 0) {
        result = head < 0 ? -1 : 0;
        goto done;
    }
    Py_ssize_t n = PyList_GET_SIZE(frames);
    Py_ssize_t spans = n + 1;
    if ((double)spans <= tail && (double)duration > slowest) { /* maybe the tail's */
        result = spend(limits, 1, tail, spans) < 0 ? -1 : 0;
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
            PyObject *done = PyObject_CallMethodOneArg(cuda, S(release), events);
            if (done == NULL)
                goto done;
            Py_DECREF(done);
        }
    }
    /* later ranges of it are queued singly and counted as sampled out; its ranges are
     * freed now, on this thread */
    if (slot_set(&ctx_owner, ctx, Py_NewRef(Py_None)) < 0 ||
        slot_set(&ctx_kept, ctx, Py_NewRef(Py_False)) < 0 ||
        PyList_SetSlice(frames, 0, n, NULL) < 0)
        goto done;
    PyObject *rows = slot_get(&state_rows, state);
    if (rows == NULL)
        goto done;
    int failed = PyList_Append(rows, row) < 0;
    Py_ssize_t batched = PyList_Check(rows) ? PyList_GET_SIZE(rows) : 0;
    Py_DECREF(rows);
    if (failed)
        goto done;
    PyObject *per_item = QUIET(ROWS_PER_ITEM);
    long most = per_item == NULL ? -1 : PyLong_AsLong(per_item);
    if (most == -1 && PyErr_Occurred())
        goto done;
    if (batched >= most) {
        PyObject *hand = QUIET(hand_rows);
        PyObject *handed = hand == NULL ? NULL : PyObject_CallOneArg(hand, state);
        if (handed == NULL)
            goto done;
        Py_DECREF(handed);
    }
    result = 1;
done:
    Py_XDECREF(row);
    Py_XDECREF(frames);
    Py_XDECREF(limits);
    Py_DECREF(phase);
    return result;
}

static PyObject *
sample_out(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (bound_call(nargs, 3, "sample_out(ctx, end_ns, state)") < 0)
        return NULL;
    if (quiet_globals == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "otelprof._speedups: bind_quiet() was not called");
        return NULL;
    }
    int out = sample_out_impl(args[0], args[1], args[2]);
    if (out < 0)
        return NULL;
    return Py_NewRef(out ? Py_True : Py_False);
}

/* ---- StepContext(step, epoch, start_ns, trim_start, phase) ---- */

/* Every slot of a StepContext: a new one starts as a copy of the template (made by
 * StepContext.__init__ at bind(), so its defaults are the class's own), then gets its own
 * number, epoch, start, phase, range list and owner. */
#define MAX_CTX_SLOTS 32
static PyTypeObject *ctx_type;
static PyObject *ctx_template;
static Py_ssize_t ctx_offsets[MAX_CTX_SLOTS];
static Py_ssize_t ctx_slot_count;
static Py_ssize_t off_step, off_epoch, off_start, off_trim_start, off_phase, off_frames, off_owner;

static int
bind_step_context(PyObject *cls, PyObject *template)
{
    ctx_type = NULL;
    if (!PyType_Check(cls) || Py_TYPE(template) != (PyTypeObject *)cls)
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
    off_step = off_epoch = off_start = off_trim_start = off_phase = off_frames = off_owner = -1;
    for (Py_ssize_t i = 0; ok && i < n; i++) {
        PyObject *name = PySequence_Fast_GET_ITEM(seq, i);
        Slot slot;
        if (slot_init(&slot, cls, name) < 0) {
            Py_DECREF(seq);
            return -1;
        }
        ok = slot.type != NULL;
        ctx_offsets[i] = slot.offset;
        const char *text = PyUnicode_AsUTF8(name);
        if (text == NULL) {
            Py_DECREF(seq);
            return -1;
        }
        Py_ssize_t *known = strcmp(text, "step") == 0         ? &off_step
                            : strcmp(text, "epoch") == 0      ? &off_epoch
                            : strcmp(text, "start_ns") == 0   ? &off_start
                            : strcmp(text, "trim_start") == 0 ? &off_trim_start
                            : strcmp(text, "phase") == 0      ? &off_phase
                            : strcmp(text, "frames") == 0     ? &off_frames
                            : strcmp(text, "owner") == 0      ? &off_owner
                                                              : NULL;
        if (known != NULL)
            *known = slot.offset;
    }
    Py_DECREF(seq);
    if (!ok || off_step < 0 || off_epoch < 0 || off_start < 0 || off_trim_start < 0 ||
        off_phase < 0 || off_frames < 0 || off_owner < 0)
        return 0; /* not the layout this code knows: StepContext() stays Python */
    for (Py_ssize_t i = 0; i < n; i++) {
        if (*(PyObject **)((char *)template + ctx_offsets[i]) == NULL)
            return 0;
    }
    ctx_slot_count = n;
    Py_XSETREF(ctx_template, Py_NewRef(template));
    ctx_type = (PyTypeObject *)cls;
    return 0;
}

static PyObject *
step_context(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (check_bound() < 0)
        return NULL;
    PyObject *cls = REC(StepContext);
    if (cls == NULL)
        return NULL;
    if ((PyTypeObject *)cls != ctx_type || nargs != 5) /* another layout: the Python class */
        return PyObject_Vectorcall(cls, args, nargs, NULL);
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
    set_slot(ctx, off_step, Py_NewRef(args[0]));
    set_slot(ctx, off_epoch, Py_NewRef(args[1]));
    set_slot(ctx, off_start, Py_NewRef(args[2]));
    set_slot(ctx, off_trim_start, Py_NewRef(args[3]));
    set_slot(ctx, off_phase, Py_NewRef(args[4]));
    set_slot(ctx, off_frames, frames);
    set_slot(ctx, off_owner, state);
    return ctx;
}

/* ---- _api.timed_items: each next() of an iterator a span ---- */

/* What the generator `_api._timed_items` does, as an iterator object: `before()`, the span
 * entered, `next(iterator)`, the span left (cancelled when the iterator is exhausted, left
 * with the exception when it raises), `after(item)`. A generator resumes a Python frame per
 * item; this runs none (the span's own enter/exit are compiled too when it is a `Timing`). */
typedef struct {
    PyObject_HEAD
    PyObject *iterator; /* NULL once finished */
    PyObject *span;
    PyObject *before; /* NULL: none */
    PyObject *after;
} TimedItems;

/* A `Timing` whose compiled enter/exit are the ones in use: called directly. */
static int
compiled_timing(PyObject *span)
{
    if (Py_TYPE(span) != timing_name.type)
        return 0;
    PyObject *on = REC(compiled);
    if (on == NULL)
        PyErr_Clear();
    return on == Py_True;
}

static int
span_enter(PyObject *span)
{
    PyObject *done = compiled_timing(span) ? timing_enter(NULL, span)
                                            : PyObject_CallMethodNoArgs(span, S(__enter__));
    Py_XDECREF(done);
    return done == NULL ? -1 : 0;
}

static int
span_exit(PyObject *span, PyObject *type, PyObject *exc, PyObject *tb)
{
    PyObject *args[5] = {span, span, type, exc, tb};
    PyObject *done = compiled_timing(span)
                         ? timing_exit(NULL, args + 1, 4)
                         : PyObject_VectorcallMethod(S(__exit__), args + 1, 4, NULL);
    Py_XDECREF(done);
    return done == NULL ? -1 : 0;
}

/* The iterator raised `exc` (taken): the span is left with it, then it is raised again. */
static void
span_fail(PyObject *span, PyObject *exc)
{
    PyObject *tb = PyException_GetTraceback(exc);
    int failed = span_exit(span, (PyObject *)Py_TYPE(exc), exc, tb == NULL ? Py_None : tb);
    Py_XDECREF(tb);
    if (failed) { /* the exit's own error wins, as in Python */
        Py_DECREF(exc);
        return;
    }
    compat_raise_exception(exc);
}

static PyObject *
timed_items_next(TimedItems *self)
{
    PyObject *iterator = self->iterator;
    if (iterator == NULL)
        return NULL;
    Py_INCREF(iterator);
    PyObject *span = Py_NewRef(self->span);
    PyObject *item = NULL;
    if (self->before != NULL) {
        PyObject *done = PyObject_CallNoArgs(self->before);
        if (done == NULL)
            goto finished;
        Py_DECREF(done);
    }
    if (span_enter(span) < 0)
        goto finished;
    item = (*Py_TYPE(iterator)->tp_iternext)(iterator);
    if (item == NULL) {
        if (PyErr_Occurred() && !PyErr_ExceptionMatches(PyExc_StopIteration)) {
            span_fail(span, compat_take_exception());
            goto finished;
        }
        PyErr_Clear(); /* exhausted: that next() was no span */
        PyObject *done = PyObject_CallMethodNoArgs(span, S(cancel));
        Py_XDECREF(done);
        goto finished;
    }
    if (span_exit(span, Py_None, Py_None, Py_None) < 0)
        goto finished;
    if (self->after != NULL) {
        PyObject *done = PyObject_CallOneArg(self->after, item);
        if (done == NULL)
            goto finished;
        Py_DECREF(done);
    }
    Py_DECREF(span);
    Py_DECREF(iterator);
    return item;
finished: /* exhausted or raised: every later next() finds it exhausted, as a generator's */
    Py_XDECREF(item);
    Py_CLEAR(self->iterator);
    Py_DECREF(span);
    Py_DECREF(iterator);
    return NULL;
}

static int
timed_items_traverse(TimedItems *self, visitproc visit, void *arg)
{
    Py_VISIT(self->iterator);
    Py_VISIT(self->span);
    Py_VISIT(self->before);
    Py_VISIT(self->after);
    return 0;
}

static int
timed_items_clear(TimedItems *self)
{
    Py_CLEAR(self->iterator);
    Py_CLEAR(self->span);
    Py_CLEAR(self->before);
    Py_CLEAR(self->after);
    return 0;
}

static void
timed_items_dealloc(TimedItems *self)
{
    PyObject_GC_UnTrack(self);
    timed_items_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject TimedItemsType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "otelprof._timings._speedups.TimedItems",
    .tp_basicsize = sizeof(TimedItems),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "timed_items(iterator, span, before, after): each next() a span",
    .tp_traverse = (traverseproc)timed_items_traverse,
    .tp_clear = (inquiry)timed_items_clear,
    .tp_dealloc = (destructor)timed_items_dealloc,
    .tp_iter = PyObject_SelfIter,
    .tp_iternext = (iternextfunc)timed_items_next,
};

static PyObject *
timed_items(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (bound_call(nargs, 4, "timed_items(iterator, span, before, after)") < 0)
        return NULL;
    PyObject *iterator = PyObject_GetIter(args[0]);
    if (iterator == NULL)
        return NULL;
    TimedItems *self = PyObject_GC_New(TimedItems, &TimedItemsType);
    if (self == NULL) {
        Py_DECREF(iterator);
        return NULL;
    }
    self->iterator = iterator;
    self->span = Py_NewRef(args[1]);
    self->before = args[2] == Py_None ? NULL : Py_NewRef(args[2]);
    self->after = args[3] == Py_None ? NULL : Py_NewRef(args[3]);
    PyObject_GC_Track(self);
    return (PyObject *)self;
}

/* ---- _api.to_device / from_device: the copies under their span ---- */

/* Leave `span` after `result` was made (NULL: with the error raised meanwhile). */
static PyObject *
leave_span(PyObject *span, PyObject *result)
{
    if (result == NULL) {
        span_fail(span, compat_take_exception());
        return NULL;
    }
    if (span_exit(span, Py_None, Py_None, Py_None) < 0) {
        Py_DECREF(result);
        return NULL;
    }
    return result;
}

static PyObject *non_blocking_names; /* ("non_blocking",) */

/* `tensor.to(device)`, or `tensor.to(device, non_blocking=True)`. */
static PyObject *
move_tensor(PyObject *tensor, PyObject *device, int non_blocking)
{
    PyObject *args[3] = {tensor, device, Py_True};
    return PyObject_VectorcallMethod(S(to), args, 2, non_blocking ? non_blocking_names : NULL);
}

/* What `_api.to_device` does once it knows no compiled region traces it: `data` (a flat
 * list or tuple, a tensor, or anything else: `nested(value, device, non_blocking)` maps what
 * is not a tensor) moved inside `span`. */
static PyObject *
move_to_device(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (bound_call(nargs, 6,
                   "move_to_device(span, data, device, non_blocking, tensor, nested)") < 0)
        return NULL;
    PyObject *span = args[0], *data = args[1], *device = args[2], *tensor = args[4];
    int non_blocking = PyObject_IsTrue(args[3]);
    if (non_blocking < 0 || span_enter(span) < 0)
        return NULL;
    PyObject *result = NULL;
    if (PyList_CheckExact(data) || PyTuple_CheckExact(data)) {
        PyObject *items = PySequence_Fast(data, "to_device");
        Py_ssize_t n = items == NULL ? 0 : PySequence_Fast_GET_SIZE(items);
        PyObject *moved = items == NULL ? NULL : PyList_New(n);
        for (Py_ssize_t i = 0; moved != NULL && i < n; i++) {
            PyObject *value = PySequence_Fast_GET_ITEM(items, i);
            PyObject *nested_args[3] = {value, device, args[3]};
            int is_tensor = PyObject_IsInstance(value, tensor);
            PyObject *out = is_tensor < 0 ? NULL
                            : is_tensor  ? move_tensor(value, device, non_blocking)
                                         : PyObject_Vectorcall(args[5], nested_args, 3, NULL);
            if (out == NULL)
                Py_CLEAR(moved);
            else
                PyList_SET_ITEM(moved, i, out);
        }
        Py_XDECREF(items);
        result = moved;
        if (moved != NULL && PyTuple_CheckExact(data)) {
            result = PyList_AsTuple(moved);
            Py_DECREF(moved);
        }
    }
    else {
        PyObject *nested_args[3] = {data, device, args[3]};
        int is_tensor = PyObject_IsInstance(data, tensor);
        result = is_tensor < 0 ? NULL
                 : is_tensor  ? move_tensor(data, device, non_blocking)
                              : PyObject_Vectorcall(args[5], nested_args, 3, NULL);
    }
    return leave_span(span, result);
}

/* What `_api.from_device` does outside compiled regions: a tensor detached and copied to the
 * host (`tensor.detach().cpu()`), anything else mapped by `nested(data)`, inside `span`. */
static PyObject *
move_to_host(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (bound_call(nargs, 4, "move_to_host(span, data, tensor, nested)") < 0)
        return NULL;
    PyObject *span = args[0], *data = args[1];
    if (span_enter(span) < 0)
        return NULL;
    int is_tensor = PyObject_IsInstance(data, args[2]);
    PyObject *result = NULL;
    if (is_tensor > 0) {
        PyObject *detached = PyObject_CallMethodNoArgs(data, S(detach));
        result = detached == NULL ? NULL : PyObject_CallMethodNoArgs(detached, S(cpu));
        Py_XDECREF(detached);
    }
    else if (is_tensor == 0)
        result = PyObject_CallOneArg(args[3], data);
    return leave_span(span, result);
}

/* ---- the helpers a training loop calls every step (`_api`), with no Python frame ---- */

/* `otelprof.train_batch()`, `reduce_metrics()`, `timing(name)`, `to_device(...)` and
 * `from_device(...)` while a profiler runs (`_helpers.HelperSwap` puts these in the
 * `otelprof` namespace, and registers the Python helpers as what torch.compile traces
 * instead of them). The common call takes the shared `Timing` or the compiled copy at once;
 * every other call (attributes, a name not seen yet, torch not imported yet, the hot path
 * off) is the Python helper's, called with the same arguments. */

static int
check_api_bound(void)
{
    if (api_globals == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "otelprof._speedups: bind_api() was not called");
        return -1;
    }
    return check_bound();
}

static int
no_keywords(PyObject *kwnames)
{
    return kwnames == NULL || PyTuple_GET_SIZE(kwnames) == 0;
}

/* The Python helper `python` (`_api`'s own function of that name) called as this one was. */
static PyObject *
python_helper(int python, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    PyObject *helper = global(api_globals, &api_cache, python);
    return helper == NULL ? NULL : PyObject_Vectorcall(helper, args, nargsf, kwnames);
}

static PyObject *
shared_timing(int shared, int python, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    if (check_api_bound() < 0)
        return NULL;
    if (PyVectorcall_NARGS(nargsf) != 0 || !no_keywords(kwnames))
        return python_helper(python, args, nargsf, kwnames);
    PyObject *timing = global(api_globals, &api_cache, shared);
    return timing == NULL ? NULL : Py_NewRef(timing);
}

static PyObject *
helper_train_batch(PyObject *module, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    return shared_timing(K__TRAIN_BATCH, K_train_batch, args, nargsf, kwnames);
}

static PyObject *
helper_reduce_metrics(PyObject *module, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    return shared_timing(K__REDUCE_METRICS, K_reduce_metrics, args, nargsf, kwnames);
}

static PyObject *
helper_timing(PyObject *module, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    if (check_api_bound() < 0)
        return NULL;
    if (PyVectorcall_NARGS(nargsf) == 1 && no_keywords(kwnames) && PyUnicode_CheckExact(args[0])) {
        PyObject *cache = REC(_timings_by_name);
        if (cache == NULL)
            return NULL;
        PyObject *timing = PyDict_CheckExact(cache) ? PyDict_GetItemWithError(cache, args[0]) : NULL;
        if (timing != NULL)
            return Py_NewRef(timing);
        if (PyErr_Occurred())
            return NULL;
    }
    return python_helper(K_timing, args, nargsf, kwnames);
}

/* torch.Tensor once `_api` has looked it up (borrowed), NULL while it has not. */
static PyObject *
known_tensor_class(void)
{
    PyObject *compiled = REC(compiled);
    PyObject *tensor = compiled == Py_True ? API(_tensor_class) : NULL;
    PyObject *none_yet = tensor == NULL ? NULL : API(_NoTensor);
    if (none_yet == NULL || tensor == none_yet) {
        PyErr_Clear(); /* the Python helper says what is wrong, if anything */
        return NULL;
    }
    return tensor;
}

static PyObject *
helper_to_device(PyObject *module, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    if (check_api_bound() < 0)
        return NULL;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *non_blocking = NULL;
    if (no_keywords(kwnames) && (nargs == 2 || nargs == 3))
        non_blocking = nargs == 3 ? args[2] : Py_False;
    else if (nargs == 2 && PyTuple_GET_SIZE(kwnames) == 1 &&
             PyUnicode_Compare(PyTuple_GET_ITEM(kwnames, 0), S(non_blocking)) == 0)
        non_blocking = args[2];
    PyObject *tensor = non_blocking == NULL ? NULL : known_tensor_class();
    PyObject *span = tensor == NULL ? NULL : API(_TO_DEVICE);
    PyObject *nested = span == NULL ? NULL : API(_nested_to_device);
    if (nested == NULL) {
        PyErr_Clear();
        return python_helper(K_to_device, args, nargsf, kwnames);
    }
    PyObject *call[6] = {span, args[0], args[1], non_blocking, tensor, nested};
    return move_to_device(NULL, call, 6);
}

static PyObject *
helper_from_device(PyObject *module, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    if (check_api_bound() < 0)
        return NULL;
    PyObject *tensor = PyVectorcall_NARGS(nargsf) == 1 && no_keywords(kwnames)
                           ? known_tensor_class()
                           : NULL;
    PyObject *span = tensor == NULL ? NULL : API(_FROM_DEVICE);
    PyObject *nested = span == NULL ? NULL : API(_nested_to_host);
    if (nested == NULL) {
        PyErr_Clear();
        return python_helper(K_from_device, args, nargsf, kwnames);
    }
    PyObject *call[4] = {span, args[0], tensor, nested};
    return move_to_host(NULL, call, 4);
}

/* A module's dict kept in `*slot`, its cache emptied (`bind_quiet()`, `bind_api()`). */
static PyObject *
bind_globals(PyObject **slot, Cache *cache, PyObject *globals, const char *usage)
{
    if (!PyDict_Check(globals)) {
        PyErr_Format(PyExc_TypeError, "%s: a module's dict", usage);
        return NULL;
    }
    memset(cache, 0, sizeof *cache);
    Py_XSETREF(*slot, Py_NewRef(globals));
    Py_RETURN_NONE;
}

static PyObject *
bind_api(PyObject *module, PyObject *globals)
{
    return bind_globals(&api_globals, &api_cache, globals, "bind_api(globals())");
}

/* ---- TimingsEngine.step ---- */

/* `TimingsEngine.step` for the common case, the one nearly every step takes: a training
 * step (phase "train") with no schedule, no Kineto session and no step listener, while the
 * compiled `sample_out` and `StepContext()` are the ones in use. It does what the Python
 * method does in that case, reading and writing the engine's slots in place; every other
 * case is the Python method (`_engine._py_step`), the reference. */
static PyTypeObject *engine_type;
static Slot eng_running, eng_ctx, eng_stepping, eng_phase, eng_listeners, eng_train_acc,
    eng_train_t0, eng_step, eng_batch, eng_from_start, eng_kineto, eng_schedule, eng_step_start,
    eng_epoch;
static PyObject *one;

/* The engine's field (borrowed; NULL when unset, no error). */
#define ENGINE_FIELD(obj, slot) (*(PyObject **)((char *)(obj) + (slot).offset))

static int
is_builtin(PyObject *function, PyCFunction impl)
{
    return PyCFunction_Check(function) && PyCFunction_GET_FUNCTION(function) == impl;
}

/* Whether the common case holds (1), or the Python step must run (0); -1 on error. */
static int
engine_common_case(PyObject *self)
{
    if (engine_globals == NULL || quiet_globals == NULL || Py_TYPE(self) != engine_type)
        return 0;
    PyObject *train = ENGINE(PHASE_TRAIN);
    PyObject *decide = train == NULL ? NULL : QUIET(sample_out);
    PyObject *make = decide == NULL ? NULL : REC(new_step_context);
    if (make == NULL)
        return -1;
    PyObject *listeners = ENGINE_FIELD(self, eng_listeners);
    return ENGINE_FIELD(self, eng_running) == Py_True && ENGINE_FIELD(self, eng_phase) == train &&
           listeners != NULL && PyList_CheckExact(listeners) && PyList_GET_SIZE(listeners) == 0 &&
           ENGINE_FIELD(self, eng_kineto) == Py_None &&
           ENGINE_FIELD(self, eng_schedule) == Py_None &&
           ENGINE_FIELD(self, eng_ctx) != NULL && ENGINE_FIELD(self, eng_step) != NULL &&
           ENGINE_FIELD(self, eng_batch) != NULL && ENGINE_FIELD(self, eng_epoch) != NULL &&
           is_builtin(decide, (PyCFunction)(void (*)(void))sample_out) &&
           is_builtin(make, (PyCFunction)(void (*)(void))step_context);
}

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
        set_slot(recorder, field_offsets[K_in_items], more);
        PyObject *done = PyObject_CallMethodOneArg(queue, S(append), item);
        Py_XDECREF(done);
        return done == NULL ? -1 : 0;
    }
    PyObject *count = PyLong_FromSsize_t(carried);
    PyObject *args[3] = {recorder, item, count};
    PyObject *done = count == NULL ? NULL : PyObject_VectorcallMethod(S(_queue_item), args, 3, NULL);
    Py_XDECREF(count);
    Py_XDECREF(done);
    return done == NULL ? -1 : 0;
}

/* `Recorder.emit_step(ctx, end)` (see there), where the Python method's five calls were
 * about 5 µs of a long step with every cache cold. `owner` is the context's owner as it was
 * read (its slot is cleared here). */
static int
emit_step_impl(PyObject *ctx, PyObject *end, PyObject *owner)
{
    PyObject *mine = get_thread_state(1);
    if (mine == NULL)
        return -1;
    int result = -1;
    PyObject *phase = NULL, *attrs = NULL, *start = NULL, *frames = NULL, *item = NULL;
    PyObject *train = REC(PHASE_TRAIN);
    PyObject *span = train == NULL ? NULL : REC(STEP_SPAN);
    PyObject *kind = span == NULL ? NULL : REC(KIND_STEP);
    phase = kind == NULL ? NULL : slot_get(&ctx_phase, ctx);
    attrs = phase == NULL ? NULL : slot_get(&ctx_attrs, ctx);
    start = attrs == NULL ? NULL : slot_get(&ctx_start, ctx);
    frames = start == NULL ? NULL : slot_get(&ctx_frames, ctx);
    if (frames == NULL)
        goto done;
    Py_ssize_t carried = PyObject_Length(frames);
    int is_train = carried < 0 ? -1 : PyObject_RichCompareBool(phase, train, Py_EQ);
    if (is_train < 0 || slot_set(&ctx_owner, ctx, Py_NewRef(Py_None)) < 0)
        goto done;
    item = PyList_New(FRAME_LEN);
    if (item == NULL)
        goto done;
    PyObject *elsewhere = owner != Py_None && owner != mine ? Py_True : Py_False;
    PyObject *fields[FRAME_LEN] = {is_train ? span : phase, zero, zero, ctx, mine, attrs,
                                   start, end, Py_None, Py_None, kind, Py_None, elsewhere};
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

/* `Recorder.emit_step` compiled (`_recorder.use_compiled`): the recorder's own, else the
 * Python method. (The engine's compiled step calls `emit_step_impl` itself.) */
static PyObject *
emit_step(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (bound_call(nargs, 3, "emit_step(recorder, ctx, end_ns)") < 0)
        return NULL;
    if (args[0] != recorder) {
        PyObject *python = REC(_py_emit_step);
        return python == NULL ? NULL : PyObject_Vectorcall(python, args, 3, NULL);
    }
    PyObject *owner = slot_get(&ctx_owner, args[1]);
    if (owner == NULL)
        return NULL;
    int failed = emit_step_impl(args[1], args[2], owner) < 0;
    Py_DECREF(owner);
    if (failed)
        return NULL;
    Py_RETURN_NONE;
}

/* End the step `ctx` at `end` (not None): decided here, or handed to the builder. */
static int
engine_end_step(PyObject *self, PyObject *ctx, PyObject *end)
{
    PyObject *state = slot_get(&ctx_owner, ctx);
    if (state == NULL)
        return -1;
    int out = state == Py_None ? 0 : sample_out_impl(ctx, end, state);
    if (out == 0)
        out = emit_step_impl(ctx, end, state);
    if (out < 0) {
        Py_DECREF(state);
        return -1;
    }
    set_slot(self, eng_stepping.offset, state);
    return 0;
}

/* The next step begins: its number, its clock, its context (recorded from now on). */
static int
engine_begin_step(PyObject *self, PyObject *clock, PyObject *end)
{
    PyObject *step = PyNumber_Add(ENGINE_FIELD(self, eng_step), one);
    if (step == NULL)
        return -1;
    set_slot(self, eng_train_acc.offset, Py_NewRef(zero));
    set_slot(self, eng_train_t0.offset, Py_NewRef(end));
    set_slot(self, eng_step.offset, Py_NewRef(step));
    PyObject *batch = PyNumber_Add(ENGINE_FIELD(self, eng_batch), one);
    if (batch == NULL) {
        Py_DECREF(step);
        return -1;
    }
    set_slot(self, eng_batch.offset, batch);
    set_slot(self, eng_from_start.offset, Py_NewRef(Py_False));
    PyObject *start = now_from(clock);
    if (start == NULL) {
        Py_DECREF(step);
        return -1;
    }
    set_slot(self, eng_step_start.offset, Py_NewRef(start));
    PyObject *epoch = Py_NewRef(ENGINE_FIELD(self, eng_epoch));
    PyObject *phase = Py_NewRef(ENGINE_FIELD(self, eng_phase));
    PyObject *args[5] = {step, epoch, start, Py_False, phase};
    PyObject *ctx = step_context(NULL, args, 5);
    Py_DECREF(step);
    Py_DECREF(epoch);
    Py_DECREF(start);
    Py_DECREF(phase);
    if (ctx == NULL)
        return -1;
    set_slot(self, eng_ctx.offset, Py_NewRef(ctx));
    set_slot(recorder, field_offsets[K_current], ctx);
    return 0;
}

static PyObject *
engine_step(PyObject *module, PyObject *self)
{
    if (check_bound() < 0)
        return NULL;
    int common = engine_common_case(self);
    if (common < 0)
        return NULL;
    if (!common) {
        PyObject *python = ENGINE(_py_step);
        return python == NULL ? NULL : PyObject_CallOneArg(python, self);
    }
    PyObject *clock = ENGINE(perf_counter_ns);
    PyObject *end = now_from(clock);
    int failed = end == NULL;
    if (!failed) {
        PyObject *ctx = Py_NewRef(ENGINE_FIELD(self, eng_ctx));
        set_slot(recorder, field_offsets[K_current], Py_NewRef(Py_None));
        failed = (ctx != Py_None && engine_end_step(self, ctx, end) < 0) ||
                 engine_begin_step(self, clock, end) < 0;
        Py_DECREF(ctx);
        Py_DECREF(end);
    }
    if (!failed)
        Py_RETURN_NONE;
    if (!PyErr_ExceptionMatches(PyExc_Exception))
        return NULL; /* KeyboardInterrupt and the like reach the caller, as in Python */
    PyObject *error = compat_take_exception();
    PyObject *report = ENGINE(step_failed);
    PyObject *done = report == NULL ? NULL : PyObject_CallOneArg(report, error);
    Py_XDECREF(error);
    if (done == NULL)
        return NULL;
    Py_DECREF(done);
    Py_RETURN_NONE;
}

/* `otelprof.step()` and `Profiler.step()`: the running engine's `step()`, with no Python
 * frame of their own (the engine's compiled step runs none either). */
static PyObject *
call_step(PyObject *engine)
{
    if (engine == Py_None)
        Py_RETURN_NONE;
    if (engine_type != NULL && Py_TYPE(engine) == engine_type) {
        /* `TimingsEngine.step` is this module's (`_engine.use_compiled`): called directly,
         * with no method lookup or bound method (about 1 µs of a long step, cold) */
        PyObject *installed = PyDict_GetItemWithError(engine_type->tp_dict, S(step));
        if (installed != NULL && PyInstanceMethod_Check(installed) &&
            is_builtin(PyInstanceMethod_GET_FUNCTION(installed), (PyCFunction)engine_step))
            return engine_step(NULL, engine);
        if (PyErr_Occurred())
            return NULL;
    }
    return PyObject_CallMethodNoArgs(engine, S(step));
}

static PyObject *
api_step(PyObject *module, PyObject *unused)
{
    if (engine_globals == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "otelprof._speedups: bind_engine() was not called");
        return NULL;
    }
    PyObject *engine = ENGINE(_active);
    return engine == NULL ? NULL : call_step(engine);
}

/* The running profiler's owner and its session's engine (`set_step_target`, strong): what
 * `owner._owner._current.timings` is, kept by the owner whenever its session changes, so
 * its `step()` reads no attribute (three generic lookups, about 2 µs of a long step). */
static PyObject *step_owner, *step_engine;

static PyObject *
set_step_target(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "set_step_target(profiler or None, engine or None)");
        return NULL;
    }
    Py_XSETREF(step_owner, args[0] == Py_None ? NULL : Py_NewRef(args[0]));
    Py_XSETREF(step_engine, Py_NewRef(args[1]));
    Py_RETURN_NONE;
}

static PyObject *
profiler_step(PyObject *module, PyObject *self)
{
    if (self == step_owner)
        return call_step(step_engine);
    PyObject *owner = PyObject_GetAttr(self, S(_owner));
    PyObject *session = owner == NULL ? NULL : PyObject_GetAttr(owner, S(_current));
    Py_XDECREF(owner);
    PyObject *engine = session == NULL ? NULL : PyObject_GetAttr(session, S(timings));
    Py_XDECREF(session);
    if (engine == NULL)
        return NULL;
    PyObject *done = call_step(engine);
    Py_DECREF(engine);
    return done;
}

static PyObject *
bind_engine(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2 || !PyType_Check(args[0]) || !PyDict_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "bind_engine(TimingsEngine, globals())");
        return NULL;
    }
    PyObject *cls = args[0];
    struct {
        Slot *slot;
        int key;
    } fields[] = {
        {&eng_running, K__running},         {&eng_ctx, K__ctx},
        {&eng_stepping, K__stepping},       {&eng_phase, K__phase},
        {&eng_listeners, K__step_listeners}, {&eng_train_acc, K__train_acc_ns},
        {&eng_train_t0, K__train_t0},       {&eng_step, K__step},
        {&eng_batch, K__batch_in_epoch},    {&eng_from_start, K__step_from_start},
        {&eng_kineto, K__kineto},           {&eng_schedule, K__schedule},
        {&eng_step_start, K__step_start},   {&eng_epoch, K__epoch},
    };
    engine_type = NULL;
    for (size_t i = 0; i < sizeof fields / sizeof fields[0]; i++) {
        if (slot_init(fields[i].slot, cls, strings[fields[i].key]) < 0)
            return NULL;
        if (fields[i].slot->type == NULL) {
            PyErr_Format(PyExc_TypeError, "bind_engine(): %U is not a __slots__ field",
                         strings[fields[i].key]);
            return NULL;
        }
    }
    memset(&engine_cache, 0, sizeof engine_cache);
    Py_XSETREF(engine_globals, Py_NewRef(args[1]));
    engine_type = (PyTypeObject *)cls;
    Py_RETURN_NONE;
}

/* ---- the builder's fold of sampled-out rows (`_sampling.fold_column`) ---- */

/* `fold_column(values, start, stride, bounds_ns, buckets)`: every `stride`-th int64 of the
 * buffer `values` from `start` (a column of `_quiet_steps` rows) counted into `buckets`
 * (bucket i holds bounds_ns[i-1] < ns <= bounds_ns[i], `bisect_left`'s), returned as
 * (count, total, low, high): what the Python reference gets by sorting the column, without
 * a Python int per duration or a sort. OverflowError when the total leaves int64 (the
 * caller then folds in Python). */
static PyObject *
fold_column(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "fold_column(values, start, stride, bounds_ns, buckets)");
        return NULL;
    }
    Py_ssize_t start = PyLong_AsSsize_t(args[1]);
    Py_ssize_t stride = start == -1 && PyErr_Occurred() ? -1 : PyLong_AsSsize_t(args[2]);
    if (stride == -1 && PyErr_Occurred())
        return NULL;
    PyObject *bounds = args[3], *buckets = args[4];
    if (start < 0 || stride <= 0 || !PyTuple_Check(bounds) || !PyList_Check(buckets) ||
        PyList_GET_SIZE(buckets) != PyTuple_GET_SIZE(bounds) + 1) {
        PyErr_SetString(PyExc_ValueError,
                        "fold_column: start >= 0, stride > 0, a tuple of bounds and a list of "
                        "one bucket more");
        return NULL;
    }
    Py_ssize_t nbounds = PyTuple_GET_SIZE(bounds);
    long long *limits = PyMem_Malloc((size_t)(nbounds ? nbounds : 1) * sizeof(long long));
    Py_ssize_t *counts = PyMem_Calloc((size_t)nbounds + 1, sizeof(Py_ssize_t));
    PyObject *result = NULL;
    Py_buffer view = {0};
    int have_view = 0;
    if (limits == NULL || counts == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < nbounds; i++) {
        limits[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(bounds, i));
        if (limits[i] == -1 && PyErr_Occurred())
            goto done;
    }
    if (PyObject_GetBuffer(args[0], &view, PyBUF_C_CONTIGUOUS) < 0)
        goto done;
    have_view = 1;
    if (view.len % (Py_ssize_t)sizeof(int64_t)) {
        PyErr_SetString(PyExc_ValueError, "fold_column: values must be whole int64s");
        goto done;
    }
    const int64_t *values = (const int64_t *)view.buf;
    Py_ssize_t n = view.len / (Py_ssize_t)sizeof(int64_t);
    Py_ssize_t count = 0;
    long long total = 0, low = 0, high = 0;
    for (Py_ssize_t at = start; at < n; at += stride) {
        long long ns = values[at];
        if (__builtin_add_overflow(total, ns, &total)) {
            PyErr_SetString(PyExc_OverflowError, "fold_column: the total leaves int64");
            goto done;
        }
        if (count == 0 || ns < low)
            low = ns;
        if (count == 0 || ns > high)
            high = ns;
        count++;
        Py_ssize_t lo = 0, hi = nbounds; /* bisect_left */
        while (lo < hi) {
            Py_ssize_t mid = (lo + hi) / 2;
            if (limits[mid] < ns)
                lo = mid + 1;
            else
                hi = mid;
        }
        counts[lo]++;
    }
    for (Py_ssize_t i = 0; i <= nbounds; i++) {
        if (!counts[i])
            continue;
        PyObject *had = PyList_GET_ITEM(buckets, i);
        PyObject *add = PyLong_FromSsize_t(counts[i]);
        PyObject *sum = add == NULL ? NULL : PyNumber_Add(had, add);
        Py_XDECREF(add);
        if (sum == NULL)
            goto done;
        PyList_SET_ITEM(buckets, i, sum);
        Py_DECREF(had);
    }
    result = Py_BuildValue("(nLLL)", count, total, low, high);
done:
    if (have_view)
        PyBuffer_Release(&view);
    PyMem_Free(limits);
    PyMem_Free(counts);
    return result;
}

/* ---- binding ---- */

static PyObject *
bind(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "bind(globals(), template StepContext, recorder)");
        return NULL;
    }
    PyObject *globals = args[0];
    if (!PyDict_Check(globals)) {
        PyErr_SetString(PyExc_TypeError, "bind(globals()): a module's dict");
        return NULL;
    }
    PyObject *timing = PyDict_GetItemWithError(globals, S(Timing));
    PyObject *state = timing == NULL ? NULL : PyDict_GetItemWithError(globals, S(ThreadState));
    PyObject *ctx = state == NULL ? NULL : PyDict_GetItemWithError(globals, S(StepContext));
    if (ctx == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "bind(): not the recorder's globals");
        return NULL;
    }
    if (slot_init(&timing_name, timing, S(name)) < 0 ||
        slot_init(&timing_attributes, timing, S(attributes)) < 0 ||
        slot_init(&state_stack, state, S(stack)) < 0 || slot_init(&state_hold, state, S(hold)) < 0 ||
        slot_init(&state_rows, state, S(rows)) < 0 || slot_init(&ctx_owner, ctx, S(owner)) < 0 ||
        slot_init(&ctx_frames, ctx, S(frames)) < 0 || slot_init(&ctx_phase, ctx, S(phase)) < 0 ||
        slot_init(&ctx_start, ctx, S(start_ns)) < 0 || slot_init(&ctx_kept, ctx, S(kept)) < 0 ||
        slot_init(&ctx_trim_start, ctx, S(trim_start)) < 0 ||
        slot_init(&ctx_error, ctx, S(error)) < 0 || slot_init(&ctx_batch, ctx, S(batch)) < 0 ||
        slot_init(&ctx_step, ctx, S(step)) < 0 || slot_init(&ctx_attrs, ctx, S(attrs)) < 0 ||
        bind_step_context(ctx, args[1]) < 0)
        return NULL;
    PyObject *rec = args[2];
    Py_ssize_t offsets[K_COUNT];
#define FIELD_OFFSET(n)                                                                   \
    {                                                                                     \
        Slot slot;                                                                        \
        if (slot_init(&slot, (PyObject *)Py_TYPE(rec), S(n)) < 0)                         \
            return NULL;                                                                  \
        if (slot.type == NULL) {                                                          \
            PyErr_SetString(PyExc_TypeError, "bind(): recorder." #n " is not a __slots__ field"); \
            return NULL;                                                                  \
        }                                                                                 \
        offsets[K_##n] = slot.offset;                                                     \
    }
    RECORDER_FIELDS(FIELD_OFFSET)
#undef FIELD_OFFSET
    memcpy(field_offsets, offsets, sizeof offsets);
    memset(&rec_cache, 0, sizeof rec_cache);
    Py_XSETREF(recorder, Py_NewRef(rec));
    Py_XSETREF(rec_globals, Py_NewRef(globals));
    Py_RETURN_NONE;
}

static PyObject *
bind_quiet(PyObject *module, PyObject *globals)
{
    return bind_globals(&quiet_globals, &quiet_cache, globals, "bind_quiet(globals())");
}

static PyObject *
method(PyObject *module, PyObject *function)
{
    return PyInstanceMethod_New(function);
}

static PyMethodDef methods[] = {
    {"set_step_target", (PyCFunction)(void (*)(void))set_step_target, METH_FASTCALL,
     "set_step_target(profiler, engine): what that profiler's step() steps (None, None: none)"},
    {"emit_step", (PyCFunction)(void (*)(void))emit_step, METH_FASTCALL,
     "Recorder.emit_step(self, ctx, end_ns)"},
    {"bind", (PyCFunction)(void (*)(void))bind, METH_FASTCALL,
     "bind(globals(), template, recorder) of otelprof._timings._recorder"},
    {"step_context", (PyCFunction)(void (*)(void))step_context, METH_FASTCALL,
     "StepContext(step, epoch, start_ns, trim_start, phase), positional"},
    {"bind_quiet", bind_quiet, METH_O, "bind_quiet(globals()) of otelprof._timings._quiet_steps"},
    {"method", method, METH_O, "method(function): a class attribute that binds like a def"},
    {"timing_enter", timing_enter, METH_O, "Timing.__enter__"},
    {"timing_exit", (PyCFunction)(void (*)(void))timing_exit, METH_FASTCALL, "Timing.__exit__"},
    {"bridge_enter", (PyCFunction)(void (*)(void))bridge_enter, METH_FASTCALL,
     "record_function.__enter__ bridged: bridge_enter(original_enter, self)"},
    {"bridge_exit", (PyCFunction)(void (*)(void))bridge_exit, METH_FASTCALL,
     "record_function.__exit__ bridged: bridge_exit(python_exit, original_exit, self, ...)"},
    {"sample_out", (PyCFunction)(void (*)(void))sample_out, METH_FASTCALL,
     "_quiet_steps.sample_out(ctx, end_ns, state)"},
    {"bind_engine", (PyCFunction)(void (*)(void))bind_engine, METH_FASTCALL,
     "bind_engine(TimingsEngine, globals()) of otelprof._timings._engine"},
    {"engine_step", engine_step, METH_O, "TimingsEngine.step"},
    {"step", api_step, METH_NOARGS,
     "step($module, /)\n--\n\nMark a training-step boundary on the running profiler (no-op "
     "when none runs)."},
    {"profiler_step", profiler_step, METH_O,
     "profiler_step($module, self, /)\n--\n\nMark a training-step boundary (like "
     "`torch.profiler.profile.step()`)."},
    {"timed_items", (PyCFunction)(void (*)(void))timed_items, METH_FASTCALL,
     "_api.timed_items(iterator, span, before, after), compiled"},
    {"move_to_device", (PyCFunction)(void (*)(void))move_to_device, METH_FASTCALL,
     "_api.to_device's copies: move_to_device(span, data, device, non_blocking, tensor, nested)"},
    {"move_to_host", (PyCFunction)(void (*)(void))move_to_host, METH_FASTCALL,
     "_api.from_device's copies: move_to_host(span, data, tensor, nested)"},
    {"bind_api", bind_api, METH_O, "bind_api(globals()) of otelprof._timings._api"},
    {"train_batch", (PyCFunction)(void (*)(void))helper_train_batch,
     METH_FASTCALL | METH_KEYWORDS,
     "train_batch($module, /, **attributes)\n--\n\n`with train_batch():` — the `train_batch` "
     "span (forward, backward, optimizer)."},
    {"reduce_metrics", (PyCFunction)(void (*)(void))helper_reduce_metrics,
     METH_FASTCALL | METH_KEYWORDS,
     "reduce_metrics($module, /, **attributes)\n--\n\n`with reduce_metrics():` — the "
     "`reduce_metrics` span."},
    {"timing", (PyCFunction)(void (*)(void))helper_timing, METH_FASTCALL | METH_KEYWORDS,
     "timing($module, name, **attributes)\n--\n\nA timing span around a block or a "
     "function (see otelprof._timings.timing)."},
    {"to_device", (PyCFunction)(void (*)(void))helper_to_device, METH_FASTCALL | METH_KEYWORDS,
     "to_device($module, data, device, non_blocking=False)\n--\n\nMove a batch (tensors, "
     "nested lists/tuples/dicts) to `device` inside a `to_device` span."},
    {"from_device", (PyCFunction)(void (*)(void))helper_from_device,
     METH_FASTCALL | METH_KEYWORDS,
     "from_device($module, data)\n--\n\nDetach and copy tensors to the host inside a "
     "`from_device` span."},
    {"fold_column", (PyCFunction)(void (*)(void))fold_column, METH_FASTCALL,
     "_sampling.fold_column(values, start, stride, bounds_ns, buckets), compiled"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef speedups = {
    PyModuleDef_HEAD_INIT,
    "otelprof._timings._speedups",
    "The training thread's hot path in C (see _speedups.c).",
    -1,
    methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC
PyInit__speedups(void)
{
#define INTERN(n)                                   \
    if ((S(n) = PyUnicode_InternFromString(#n)) == NULL) \
        return NULL;
    STRINGS(INTERN)
#undef INTERN
    zero = PyLong_FromLong(0);
    one = PyLong_FromLong(1);
    non_blocking_names = Py_BuildValue("(s)", "non_blocking");
    PyObject *time = PyImport_ImportModule("time");
    real_clock = time == NULL ? NULL : PyObject_GetAttrString(time, "perf_counter_ns");
    Py_XDECREF(time);
    if (zero == NULL || one == NULL || non_blocking_names == NULL || real_clock == NULL)
        return NULL;
    if (PyType_Ready(&TimedItemsType) < 0)
        return NULL;
    PyObject *module = PyModule_Create(&speedups);
    PyObject *layout = module == NULL ? NULL : Py_BuildValue(
        "{sisisisisisisisisisisisisisisi}", "F_NAME", F_NAME, "F_SPAN", F_SPAN, "F_PARENT",
        F_PARENT, "F_CTX", F_CTX, "F_THREAD", F_THREAD, "F_ATTRS", F_ATTRS, "F_START", F_START,
        "F_END", F_END, "F_ERROR", F_ERROR, "F_CUDA", F_CUDA, "F_KIND", F_KIND, "F_OWNER", F_OWNER,
        "F_RANGE", F_RANGE, "RF_LEN", RF_FRAME_LEN, "TIMING_LEN", FRAME_LEN);
    if (layout == NULL || PyModule_AddObject(module, "FRAME_LAYOUT", layout) < 0) {
        Py_XDECREF(layout);
        Py_XDECREF(module);
        return NULL;
    }
    if (PyModule_AddStringConstant(module, "CPYTHON_CHECKED", OTELPROF_CPYTHON_CHECKED) < 0 ||
        PyModule_AddIntConstant(module, "VERSION_TAGS", COMPAT_VERSION_TAGS) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
