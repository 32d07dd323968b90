/*
 * Error-path driver for tests/test_coupling.py: bad input to libdomainpar from C.
 *
 * Usage: mpiexec -n N coupling_errors_c OUT_DIR SURROGATE_ENTRY
 * Every rank writes OUT_DIR/rank<r>.txt with one line per case,
 *   case <name> code <rc> message <dp_last_error()>
 * and a last line "done" once every case has returned: the simulation goes on
 * after each failure. The test checks each case's code on every rank, that
 * every rank has the same message, and what the message says.
 * Blocks: 4 x 3 cells per rank on a periodic 2-D grid from MPI_Dims_create.
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "domainpar.h"

static FILE *out;

static void record(const char *name, int rc) {
  fprintf(out, "case %s code %d message %s\n", name, rc, dp_last_error());
  fflush(out);
}

int main(int argc, char **argv) {
  int rank, size, dims[2] = {0, 0}, periods[2] = {1, 1};
  char path[4096], kwargs[256];
  MPI_Comm cart;
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (argc < 3) {
    if (rank == 0) fprintf(stderr, "usage: coupling_errors_c OUT_DIR SURROGATE_ENTRY\n");
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  snprintf(path, sizeof path, "%s/rank%d.txt", argv[1], rank);
  out = fopen(path, "w");
  const char *entry = argv[2];
  const int last = size - 1;

  record("before_init", dp_infer(1, 1, 1));  /* local: DP_ERR_STATE */
  MPI_Dims_create(size, 2, dims);
  MPI_Cart_create(MPI_COMM_WORLD, 2, dims, periods, 0, &cart);
  record("init", dp_init(cart, 0, NULL, NULL));
  record("init_twice", dp_init(cart, 0, NULL, NULL));

  enum { NX = 4, NY = 3 };
  double u[(NX + 2) * (NY + 2)], v[(NX + 2) * (NY + 2)], two[NX * NY * 2];
  for (int k = 0; k < (NX + 2) * (NY + 2); k++) u[k] = v[k] = k;
  int shape[3] = {NX, NY, 2}, one[3] = {1, 1, 0}, fu = 0, fv = 0, f = 0, model = 0;
  record("field_ok", dp_field_create(&fu, u, DP_FLOAT64, DP_ORDER_C, 2, shape, one, one));
  record("field_ok2", dp_field_create(&fv, v, DP_FLOAT64, DP_ORDER_C, 2, shape, one, one));

  /* A null pointer on the last rank only. */
  record("null_pointer", dp_field_create(&f, rank == last ? NULL : u, DP_FLOAT64, DP_ORDER_C, 2,
                                         shape, one, one));
  /* Wrong shape: the last rank's block is one cell longer along y, which no grid
   * allows when another rank shares its y coordinate (or here: its y extent
   * must match the others' on a grid of one column). */
  int bad[2] = {NX, rank == last ? NY + 1 : NY};
  record("wrong_shape_blocks", dp_field_create(&f, u, DP_FLOAT64, DP_ORDER_C, 2, bad, NULL, NULL));
  record("bad_dtype", dp_field_create(&f, u, 7, DP_ORDER_C, 2, shape, one, one));
  int offset[2] = {12345, 0};
  record("wrong_offset", dp_field_create_ex(&f, u, DP_FLOAT64, DP_ORDER_C, 2, shape, one, one,
                                            NULL, offset, DP_HOST));

  record("import_module", dp_model_load(&model, "no_such_module_xyz:factory", NULL, NULL));
  record("import_file", dp_model_load(&model, "/no/such/dir/model.py:factory", NULL, NULL));
  record("import_attr", dp_model_load(&model, "json:no_such_factory", NULL, NULL));
  record("bad_json", dp_model_load(&model, entry, "{channels: 8", NULL));
  record("bad_optimizer", dp_model_load(&model, entry, NULL, "{\"optimizer\": \"adamax9\"}"));

  /* A Python exception inside the model: on every rank, then on the last rank only
   * (after the model's communication, so the others are not left waiting). */
  int bad_model = 0;
  snprintf(kwargs, sizeof kwargs, "{\"channels\": 2, \"raise_on_ranks\": [%s]}",
           size == 1 ? "0" : size == 2 ? "0, 1" : size == 3 ? "0, 1, 2" : "0, 1, 2, 3");
  record("load_failing_model", dp_model_load(&bad_model, entry, kwargs,
                                             "{\"dtype\": \"float64\", \"optimizer\": \"sgd\"}"));
  record("model_raises_everywhere", dp_infer(bad_model, fu, fv));
  double loss = -1;
  record("train_raises_everywhere", dp_train_step(bad_model, fu, fv, &loss));
  dp_model_free(bad_model);
  snprintf(kwargs, sizeof kwargs, "{\"channels\": 2, \"raise_on_ranks\": [%d]}", last);
  record("load_failing_model_last", dp_model_load(&bad_model, entry, kwargs,
                                                  "{\"dtype\": \"float64\"}"));
  record("model_raises_on_last", dp_infer(bad_model, fu, fv));

  /* Wrong shape: a 2-component output field for a 1-channel model. */
  record("load_model", dp_model_load(&model, entry, "{\"channels\": 2}", "{\"dtype\": \"float64\"}"));
  int fc = 0, shape_c[3] = {NX, NY, 2};
  record("field_components", dp_field_create(&fc, two, DP_FLOAT64, DP_ORDER_C, 3, shape_c, NULL,
                                             NULL));
  record("wrong_shape_output", dp_infer(model, fu, fc));
  record("no_optimizer", dp_train_step(model, fu, fv, &loss));
  record("unknown_field", dp_infer(model, fu, 999));
  record("float32_model", dp_model_free(model) == DP_OK
                              ? dp_model_load(&model, entry, "{\"channels\": 2}", NULL) : -1);
  record("dtype_mismatch", dp_infer(model, fu, fv));
  record("save_io", dp_model_save(model, "/no/such/dir/model.pt"));

  /* The simulation goes on: a good call after all that. */
  dp_model_free(model);
  record("load_model_again", dp_model_load(&model, entry, "{\"channels\": 2}",
                                           "{\"dtype\": \"float64\"}"));
  record("infer_ok", dp_infer(model, fu, fv));
  record("finalize", dp_finalize());
  record("after_finalize", dp_infer(model, fu, fv));
  fprintf(out, "done\n");
  fclose(out);
  MPI_Comm_free(&cart);
  MPI_Finalize();
  return 0;
}
