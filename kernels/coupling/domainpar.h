/*
 * libdomainpar: domain-parallel PyTorch models inside a C or Fortran MPI
 * simulation, on the simulation's own decomposition and memory.
 *
 * The simulation keeps its communicator, its Cartesian decomposition and its
 * arrays (owned cells plus ghost cells). It describes each array once as a
 * *field*; domainpar then runs a model on the distributed field without
 * gathering it and without copying it (the model reads the simulation's
 * memory through views; only an output is copied, into the output field).
 *
 * Every call is collective over the simulation's grid: all ranks make the same
 * calls in the same order. Every call returns DP_OK or a DP_ERR_* code, and the
 * code and the message (dp_last_error) are the same on every rank, so a
 * simulation can branch on them without deadlocking; nothing in here aborts
 * the job. A Python model that fails on some ranks inside its own
 * communication can still hang, as any MPI code would.
 *
 * Call sequence:
 *   MPI_Init ... MPI_Cart_create(..., &cart)
 *   dp_init(cart, 0, NULL, NULL)                  grid = the communicator's topology
 *   dp_field_create(&u_field, u, DP_FLOAT64, DP_ORDER_C, 2, shape, lo, hi)
 *   dp_model_load(&model, "pkg.module:factory", "{\"channels\": 8}",
 *                 "{\"optimizer\": {\"name\": \"adam\", \"lr\": 0.01}}")
 *   loop: dp_infer(model, in, out); dp_train_step(model, in, target, &loss);
 *         dp_halo_fill(u_field)
 *   dp_model_save(model, "surrogate.pt"); dp_finalize(); MPI_Finalize()
 *
 * Python: the library starts an embedded CPython on the first dp_init (or uses
 * the one the process already runs). It takes the Python environment from the
 * DOMAINPAR_PYTHON environment variable (the path of that environment's
 * python executable), else from the python recorded when the library was
 * built (dp_python_default()). PYTHONPATH is honoured, e.g. for the module of
 * a model's entry point.
 */
#ifndef DOMAINPAR_H
#define DOMAINPAR_H

#include <mpi.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Return codes (the same values in the Fortran module and domainpar.coupling.errors). */
enum {
  DP_OK = 0,
  DP_ERR_ARGUMENT = 1, /* null pointer, unknown code or handle, descriptions differing between ranks */
  DP_ERR_SHAPE = 2,    /* extents that do not fit: grid, blocks across ranks, model output */
  DP_ERR_IMPORT = 3,   /* the model's entry point does not import */
  DP_ERR_MODEL = 4,    /* the model (factory, forward, loss, backward, optimizer) raised */
  DP_ERR_IO = 5,       /* a checkpoint could not be written or read */
  DP_ERR_STATE = 6,    /* a call before dp_init or after dp_finalize */
  DP_ERR_PYTHON = 7    /* the embedded Python could not start, or an internal error */
};

/* Element types, storage orders and memory locations of a field. */
enum { DP_FLOAT32 = 1, DP_FLOAT64 = 2 };
enum { DP_ORDER_C = 0, /* last index fastest */ DP_ORDER_F = 1 /* first index fastest */ };
enum { DP_HOST = 0, DP_DEVICE = 1 /* CUDA device pointer, seen through CuPy (not yet run on a GPU) */ };

/* Start domainpar on the simulation's grid. ndims == 0 (dims, periods NULL):
 * comm must carry a Cartesian topology (MPI_Cart_create), which is adopted.
 * Otherwise a Cartesian grid with dims[ndims] and periods[ndims] (nonzero =
 * periodic) is made over comm without reordering, i.e. with the coordinates
 * MPI_Cart_create(comm, ndims, dims, periods, 0, ...) gives. domainpar works
 * on a duplicate, so its messages never mix with the simulation's.
 * MPI must be initialised. */
int dp_init(MPI_Comm comm, int ndims, const int *dims, const int *periods);
/* The same with a Fortran communicator handle (MPI_Comm_c2f). */
int dp_init_f(MPI_Fint comm, int ndims, const int *dims, const int *periods);

/* Describe an array of the simulation as a field; *field gets its handle.
 * data:   the first element of the padded array (ghosts included);
 * shape:  owned (interior) extents, ndim of them, in the simulation's index
 *         order; the array holds ghost_lo[d] + shape[d] + ghost_hi[d] cells
 *         along dim d (ghost_lo/hi NULL: no ghosts);
 * order:  DP_ORDER_C or DP_ORDER_F.
 * Dim d is cut along grid axis d; the field has one dim per grid axis, and may
 * have one more (the last) holding components, which the model sees as
 * channels. The model sees the tensor (1, C, s_0, ..., s_{g-1}): spatial dims
 * ordered by grid axis. The memory must stay valid until dp_field_free. */
int dp_field_create(int *field, void *data, int dtype, int order, int ndim, const int *shape,
                    const int *ghost_lo, const int *ghost_hi);
/* The same, plus:
 * axes:          grid axis cutting each dim, -1 for the component dim (NULL: as above);
 * global_offset: global index of the first owned cell per dim, checked against
 *                the grid (NULL: not checked);
 * location:      DP_HOST, or DP_DEVICE for a CUDA device pointer. */
int dp_field_create_ex(int *field, void *data, int dtype, int order, int ndim, const int *shape,
                       const int *ghost_lo, const int *ghost_hi, const int *axes,
                       const int *global_offset, int location);
int dp_field_free(int field);

/* Fill the field's ghost cells from their owners with domainpar's exchange
 * (periodic grid axes wrap; corners included; ghosts outside a non-periodic
 * domain are left as they are), for a simulation's own stencils. */
int dp_halo_fill(int field);

/* Load a model. entry: "package.module:factory" or "/path/to/file.py:factory",
 * a callable returning a torch.nn.Module; kwargs_json: a JSON object of
 * keyword arguments for it (NULL or "" for none). Or entry: a TorchScript file
 * (.pt, .pth, .ts, .torchscript), run block by block with "halo" ghost cells
 * (option "halo": the model's receptive-field radius; periodic grids only).
 * options_json: {"optimizer":
 * "adam" or {"name": "adam", "lr": 1e-3, ...} (sgd, adam, adamw, rmsprop; none:
 * inference only), "loss": "mse" | "l1" | "smooth_l1", "dtype": "float32" |
 * "float64", "device": "cpu" | "cuda", "seed": 0}. Parameters are made equal
 * on every rank (broadcast from rank 0). */
int dp_model_load(int *model, const char *entry, const char *kwargs_json,
                  const char *options_json);
int dp_model_free(int model);

/* out <- model(in), in eval mode without autograd. The output's global shape
 * must be the output field's; the owned cells of out are written, its ghosts
 * are not. */
int dp_infer(int model, int field_in, int field_out);
/* One optimizer step on loss(model(in), target); *loss (may be NULL) gets the
 * loss before the step, the same on every rank. */
int dp_train_step(int model, int field_in, int field_target, double *loss);

/* Checkpoints: parameters, buffers, optimizer state, step count. Rank 0 writes
 * the file (atomically) and rank 0 reads it; the others get it from rank 0. */
int dp_model_save(int model, const char *path);
int dp_model_restore(int model, const char *path);

/* The message of the last failed call on this rank ("" after a success) and its code. */
const char *dp_last_error(void);
int dp_last_error_code(void);

/* Drop every field and model, then shut the embedded Python down if this
 * library started it. Call before MPI_Finalize. domainpar cannot be started
 * again in the same process afterwards (CPython cannot re-initialise numpy or
 * torch). */
int dp_finalize(void);

/* The python executable recorded at build time (the default environment). */
const char *dp_python_default(void);

/* For the Fortran module: dp_field_create_ex with a problem this rank found
 * before calling (non-NULL: reported as this rank's DP_ERR_ARGUMENT, agreed
 * on every rank like any other error). */
int dp_field_create_checked(int *field, void *data, int dtype, int order, int ndim,
                            const int *shape, const int *ghost_lo, const int *ghost_hi,
                            const int *axes, const int *global_offset, int location,
                            const char *local_problem);

#ifdef __cplusplus
}
#endif

#endif /* DOMAINPAR_H */
