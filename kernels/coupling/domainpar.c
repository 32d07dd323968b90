/*
 * libdomainpar: the C side of domainpar's coupling API (see domainpar.h).
 *
 * Design: the library embeds CPython with the plain C API and forwards every
 * call to domainpar.coupling.api, which does all checking and agreement across
 * ranks. Why CPython embedding and not cffi's embedding mode: the calls are few
 * and their arguments simple (integers, tuples, strings), so a page of C
 * against the stable embedding API does it, with no cffi at build or run time
 * and no generated sources; the simulation links this one library (and,
 * through it, libpython) and needs to know nothing else.
 *
 * Why so little is checked here: an argument problem found on one rank must
 * still reach every rank, or the others would wait forever in the next
 * collective. So C-level problems (a NULL out-pointer, say) are passed on as
 * this rank's "local problem", and Python agrees on the outcome of every call.
 *
 * The GIL is released between calls (PyEval_SaveThread), and each call takes
 * it with PyGILState_Ensure, so the calls may come from any one thread at a
 * time, e.g. an OpenMP master thread.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "domainpar.h"

#ifndef DP_DEFAULT_PYTHON
#define DP_DEFAULT_PYTHON ""
#endif

enum { NOT_STARTED, RUNNING, FINALIZED };

static int state = NOT_STARTED;
static int started_python = 0;          /* this library initialised the interpreter */
static PyThreadState *main_thread = NULL;
static PyObject *api = NULL;            /* domainpar.coupling.api */
static char last_error[8192];
static int last_code = DP_OK;

static int set_error(int code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(last_error, sizeof last_error, fmt, ap);
  va_end(ap);
  last_code = code;
  return code;
}

static int succeed(void) {
  last_error[0] = '\0';
  last_code = DP_OK;
  return DP_OK;
}

const char *dp_last_error(void) { return last_error; }
int dp_last_error_code(void) { return last_code; }
const char *dp_python_default(void) { return DP_DEFAULT_PYTHON; }

/* The pending Python exception as text (GIL held); clears it. */
static void exception_text(char *buf, size_t len) {
  PyObject *type = NULL, *value = NULL, *tb = NULL;
  PyErr_Fetch(&type, &value, &tb);  /* PyErr_GetRaisedException is 3.12+ */
  PyErr_NormalizeException(&type, &value, &tb);
  PyObject *text = value ? PyObject_Str(value) : NULL;
  const char *s = text ? PyUnicode_AsUTF8(text) : NULL;
  snprintf(buf, len, "%s: %s", type ? ((PyTypeObject *)type)->tp_name : "unknown error",
           s ? s : "?");
  Py_XDECREF(text);
  Py_XDECREF(type);
  Py_XDECREF(value);
  Py_XDECREF(tb);
  PyErr_Clear();
}

static const char *python_path(void) {
  const char *p = getenv("DOMAINPAR_PYTHON");
  return (p && *p) ? p : DP_DEFAULT_PYTHON;
}

/* Start the interpreter (unless the process already runs one) and import the
 * API module. Local: the same environment gives every rank the same outcome. */
static int start_python(void) {
  if (!Py_IsInitialized()) {
    PyConfig config;
    PyConfig_InitPythonConfig(&config);  /* honours PYTHONPATH and friends */
    /* The simulation owns the signals (SIGINT goes to MPI's launcher). */
    config.install_signal_handlers = 0;
    config.parse_argv = 0;
    /* Setting program_name to an environment's python makes CPython find that
     * environment as it would for the executable itself: a venv's pyvenv.cfg,
     * its site-packages, the base installation's standard library. */
    const char *py = python_path();
    PyStatus status = PyStatus_Ok();
    if (*py) status = PyConfig_SetBytesString(&config, &config.program_name, py);
    if (!PyStatus_Exception(status)) status = Py_InitializeFromConfig(&config);
    PyConfig_Clear(&config);
    if (PyStatus_Exception(status))
      return set_error(DP_ERR_PYTHON, "dp_init: the embedded Python did not start with %s: %s",
                       *py ? py : "(no python recorded)",
                       status.err_msg ? status.err_msg : "unknown reason");
    started_python = 1;
  }
  PyGILState_STATE gil = PyGILState_Ensure();
  /* The simulation owns MPI: mpi4py must neither initialise nor finalize it.
   * (mpi4py reads rc when mpi4py.MPI is first imported, by domainpar.) */
  PyObject *mpi4py = PyImport_ImportModule("mpi4py");
  PyObject *rc_options = mpi4py ? PyObject_GetAttrString(mpi4py, "rc") : NULL;
  if (rc_options) {
    PyObject_SetAttrString(rc_options, "initialize", Py_False);
    PyObject_SetAttrString(rc_options, "finalize", Py_False);
  }
  Py_XDECREF(rc_options);
  Py_XDECREF(mpi4py);
  PyErr_Clear();  /* without mpi4py the import below fails and says so */
  api = PyImport_ImportModule("domainpar.coupling.api");
  int rc = DP_OK;
  if (!api) {
    char why[2048];
    exception_text(why, sizeof why);
    rc = set_error(DP_ERR_PYTHON,
                   "dp_init: cannot import domainpar.coupling.api in the Python of %s (%s); set "
                   "DOMAINPAR_PYTHON to the python executable of the environment where "
                   "domainpar is installed",
                   *python_path() ? python_path() : "this process", why);
  }
  PyGILState_Release(gil);
  if (started_python) main_thread = PyEval_SaveThread();  /* let other threads take the GIL */
  return rc;
}

/* A tuple of n C ints, or None for NULL (new reference; GIL held). */
static PyObject *ints(const int *a, int n) {
  if (!a || n < 0) Py_RETURN_NONE;
  PyObject *t = PyTuple_New(n);
  for (int i = 0; t && i < n; i++) PyTuple_SET_ITEM(t, i, PyLong_FromLong(a[i]));
  return t;
}

/* A str, or None for NULL (new reference; GIL held). */
static PyObject *str(const char *s) {
  if (!s) Py_RETURN_NONE;
  return PyUnicode_DecodeUTF8(s, (Py_ssize_t)strlen(s), "replace");
}

/* Call api.<name>(*args) (args stolen; GIL held). The result (code, message,
 * value) sets the error state; the value goes to *int_out or *double_out when
 * those are given and it is not None. */
static int call(const char *name, PyObject *args, int *int_out, double *double_out) {
  int code;
  PyObject *result = NULL;
  if (!args) {
    char why[1024];
    exception_text(why, sizeof why);
    return set_error(DP_ERR_PYTHON, "%s: could not build the arguments: %s", name, why);
  }
  PyObject *fn = PyObject_GetAttrString(api, name);
  if (fn) result = PyObject_CallObject(fn, args);
  Py_XDECREF(fn);
  Py_DECREF(args);
  if (!result || !PyTuple_Check(result) || PyTuple_GET_SIZE(result) != 3) {
    char why[2048] = "the call did not return (code, message, value)";
    if (PyErr_Occurred()) exception_text(why, sizeof why);
    Py_XDECREF(result);
    return set_error(DP_ERR_PYTHON, "%s: internal error (on this rank only): %s", name, why);
  }
  code = (int)PyLong_AsLong(PyTuple_GET_ITEM(result, 0));
  const char *message = PyUnicode_AsUTF8(PyTuple_GET_ITEM(result, 1));
  PyObject *value = PyTuple_GET_ITEM(result, 2);
  if (code == DP_OK && value != Py_None) {
    if (int_out) *int_out = (int)PyLong_AsLong(value);
    if (double_out) *double_out = PyFloat_AsDouble(value);
  }
  if (code == DP_OK) succeed();
  else set_error(code, "%s", message ? message : "(no message)");
  Py_DECREF(result);
  PyErr_Clear();
  return code;
}

/* Every call after dp_init: check the state and take the GIL; the arguments
 * are built after this (building Python objects needs the GIL). */
static int enter(const char *name, PyGILState_STATE *gil) {
  if (state != RUNNING)
    return set_error(DP_ERR_STATE, "dp_%s: %s", name,
                     state == FINALIZED ? "domainpar is finalized" : "call dp_init first");
  *gil = PyGILState_Ensure();
  return DP_OK;
}

/* enter, call api.<name>(*args) with args built by Py_VaBuildValue, leave. */
static int forward(const char *name, int *int_out, double *double_out, const char *format, ...) {
  PyGILState_STATE gil = PyGILState_UNLOCKED;
  int rc = enter(name, &gil);
  if (rc != DP_OK) return rc;
  va_list ap;
  va_start(ap, format);
  rc = call(name, Py_VaBuildValue(format, ap), int_out, double_out);
  va_end(ap);
  PyGILState_Release(gil);
  return rc;
}

/* Seconds a rank waits for its peers where one may never come
 * (DOMAINPAR_FAULT_TIMEOUT, default 60; 0 waits forever). */
static double fault_timeout(void) {
  const char *t = getenv("DOMAINPAR_FAULT_TIMEOUT");
  return (t && *t) ? atof(t) : 60.0;
}

/* Collective over comm, with a deadline: *dup becomes a duplicate of comm once
 * every rank of comm has called. A rank that passed MPI_COMM_NULL or another
 * communicator, or never calls, cannot be told; the others return
 * DP_ERR_ARGUMENT after fault_timeout() seconds instead of waiting forever. */
static int join(MPI_Comm comm, MPI_Comm *dup) {
  MPI_Request request;
  if (comm == MPI_COMM_NULL)
    return set_error(DP_ERR_ARGUMENT, "dp_init: the communicator is MPI_COMM_NULL on this rank; "
                     "the other ranks cannot be told (they return DP_ERR_ARGUMENT after "
                     "DOMAINPAR_FAULT_TIMEOUT seconds): abort the job");
  MPI_Comm_idup(comm, dup, &request);
  double limit = fault_timeout(), start = MPI_Wtime();
  int done = 0;
  for (;;) {
    MPI_Test(&request, &done, MPI_STATUS_IGNORE);
    if (done) return DP_OK;
    if (limit > 0 && MPI_Wtime() - start > limit) break;
    struct timespec pause = {0, 1000000};
    nanosleep(&pause, NULL);
  }
  *dup = MPI_COMM_NULL;
  return set_error(DP_ERR_ARGUMENT, "dp_init: not every rank of the communicator called dp_init "
                   "with it within %g s (DOMAINPAR_FAULT_TIMEOUT): a rank passed MPI_COMM_NULL "
                   "or another communicator, or did not call dp_init. The communicator may be "
                   "unusable now: abort the job", limit);
}

/* Collective over comm. Every rank learns whether the embedded Python started on
 * every rank; if not, all return DP_ERR_PYTHON naming each failing rank's reason. */
static int agree_start(MPI_Comm comm, int rc) {
  enum { LEN = 1024 };
  int failed = rc != DP_OK, any = 0, size = 1;
  MPI_Allreduce(&failed, &any, 1, MPI_INT, MPI_MAX, comm);
  if (!any) return DP_OK;
  MPI_Comm_size(comm, &size);
  char mine[LEN] = "", *all = calloc((size_t)size, LEN);
  const char *why = strncmp(last_error, "dp_init: ", 9) ? last_error : last_error + 9;
  if (failed) snprintf(mine, LEN, "%.*s", LEN - 1, why);  /* cut to the slot */
  if (!all) return set_error(DP_ERR_PYTHON, "dp_init: the embedded Python did not start on "
                             "every rank (out of memory for the details)");
  MPI_Allgather(mine, LEN, MPI_CHAR, all, LEN, MPI_CHAR, comm);
  char text[sizeof last_error] = "";
  size_t used = 0;
  for (int r = 0; r < size && used < sizeof text; r++)
    if (all[(size_t)r * LEN])
      used += (size_t)snprintf(text + used, sizeof text - used, "%srank %d: %.*s",
                               used ? "; " : "", r, LEN, all + (size_t)r * LEN);
  free(all);
  return set_error(DP_ERR_PYTHON, "dp_init: %s", text);
}

int dp_init_f(MPI_Fint comm, int ndims, const int *dims, const int *periods) {
  int mpi_up = 0, mpi_down = 0;
  MPI_Initialized(&mpi_up);
  MPI_Finalized(&mpi_down);
  if (!mpi_up || mpi_down)
    return set_error(DP_ERR_STATE, "dp_init: MPI is %s", mpi_down ? "finalized" : "not initialised "
                     "(call MPI_Init first: the simulation owns MPI)");
  if (state == FINALIZED)
    return set_error(DP_ERR_STATE, "dp_init: domainpar is finalized; it cannot start again in "
                     "this process");
  MPI_Comm dup = MPI_COMM_NULL;
  int rc = join(MPI_Comm_f2c(comm), &dup);
  if (rc != DP_OK) return rc;
  if (state == NOT_STARTED) {
    rc = start_python();
    if (rc == DP_OK) state = RUNNING;
  }
  rc = agree_start(dup, rc);
  if (rc == DP_OK) {
    PyGILState_STATE gil = PyGILState_Ensure();
    int given = ndims > 0 && dims;
    PyObject *args = Py_BuildValue("(lNN)", (long)MPI_Comm_c2f(dup),
                                   given ? ints(dims, ndims) : ints(NULL, 0),
                                   given && periods ? ints(periods, ndims) : ints(NULL, 0));
    rc = call("init", args, NULL, NULL);
    PyGILState_Release(gil);
  }
  MPI_Comm_free(&dup);  /* domainpar's grid holds its own duplicate */
  return rc;
}

int dp_init(MPI_Comm comm, int ndims, const int *dims, const int *periods) {
  int mpi_up = 0;
  MPI_Initialized(&mpi_up);
  if (!mpi_up) return dp_init_f(0, ndims, dims, periods);  /* reports the missing MPI_Init */
  return dp_init_f(MPI_Comm_c2f(comm), ndims, dims, periods);
}

int dp_field_create_checked(int *field, void *data, int dtype, int order, int ndim,
                            const int *shape, const int *ghost_lo, const int *ghost_hi,
                            const int *axes, const int *global_offset, int location,
                            const char *local_problem) {
  int handle = 0;
  if (local_problem && !*local_problem) local_problem = NULL;  /* Fortran passes "" for none */
  if (!local_problem && !field) local_problem = "null pointer for the field handle";
  if (!local_problem && !shape && ndim > 0) local_problem = "null pointer for the shape";
  if (!local_problem && ndim < 0) local_problem = "negative ndim";
  if (local_problem) ndim = 0;  /* the arrays may not be readable */
  PyGILState_STATE gil = PyGILState_UNLOCKED;
  int rc = enter("field_create", &gil);
  if (rc != DP_OK) return rc;
  rc = call("field_create",
            Py_BuildValue("(KiiNNNNNiN)", (unsigned long long)(uintptr_t)data, dtype, order,
                          ints(shape, ndim), ints(ghost_lo, ndim), ints(ghost_hi, ndim),
                          ints(axes, ndim), ints(global_offset, ndim), location,
                          str(local_problem)),
            &handle, NULL);
  PyGILState_Release(gil);
  if (field) *field = rc == DP_OK ? handle : 0;
  return rc;
}

int dp_field_create_ex(int *field, void *data, int dtype, int order, int ndim, const int *shape,
                       const int *ghost_lo, const int *ghost_hi, const int *axes,
                       const int *global_offset, int location) {
  return dp_field_create_checked(field, data, dtype, order, ndim, shape, ghost_lo, ghost_hi, axes,
                                 global_offset, location, NULL);
}

int dp_field_create(int *field, void *data, int dtype, int order, int ndim, const int *shape,
                    const int *ghost_lo, const int *ghost_hi) {
  return dp_field_create_checked(field, data, dtype, order, ndim, shape, ghost_lo, ghost_hi, NULL,
                                 NULL, DP_HOST, NULL);
}

int dp_field_free(int field) { return forward("field_free", NULL, NULL, "(i)", field); }
int dp_halo_fill(int field) { return forward("halo_fill", NULL, NULL, "(i)", field); }

int dp_model_load(int *model, const char *entry, const char *kwargs_json,
                  const char *options_json) {
  int handle = 0;
  PyGILState_STATE gil = PyGILState_UNLOCKED;
  int rc = enter("model_load", &gil);
  if (rc != DP_OK) return rc;
  rc = call("model_load",
            Py_BuildValue("(NNNN)", str(entry), str(kwargs_json), str(options_json),
                          str(model ? NULL : "null pointer for the model handle")),
            &handle, NULL);
  PyGILState_Release(gil);
  if (model) *model = rc == DP_OK ? handle : 0;
  return rc;
}

int dp_model_free(int model) { return forward("model_free", NULL, NULL, "(i)", model); }

int dp_infer(int model, int field_in, int field_out) {
  return forward("infer", NULL, NULL, "(iii)", model, field_in, field_out);
}

int dp_train_step(int model, int field_in, int field_target, double *loss) {
  double value = 0.0;
  int rc = forward("train_step", NULL, &value, "(iii)", model, field_in, field_target);
  if (loss) *loss = value;
  return rc;
}

int dp_model_save(int model, const char *path) {
  return forward("model_save", NULL, NULL, "(is)", model, path ? path : "");
}

int dp_model_restore(int model, const char *path) {
  return forward("model_restore", NULL, NULL, "(is)", model, path ? path : "");
}

int dp_finalize(void) {
  int rc = forward("finalize", NULL, NULL, "()");
  if (state != RUNNING) return rc;
  state = FINALIZED;
  PyGILState_STATE gil = PyGILState_Ensure();
  Py_CLEAR(api);
  PyGILState_Release(gil);
  if (started_python) {
    /* Flush what Python buffered, then shut it down while MPI is still up
     * (mpi4py leaves MPI itself alone: rc.finalize = False). */
    PyEval_RestoreThread(main_thread);
    if (Py_FinalizeEx() < 0 && rc == DP_OK)
      rc = set_error(DP_ERR_PYTHON, "dp_finalize: the embedded Python did not shut down cleanly");
  }
  return rc;
}
