/*
 * Fault driver for tests/test_coupling_faults.py: one misuse or fault per run.
 *
 * Usage: mpiexec -n N coupling_faults_c OUT_DIR CASE MODEL_ENTRY
 * Every rank writes OUT_DIR/rank<r>.txt, one line per call,
 *   case <name> code <rc> message <dp_last_error()>
 * (values: "value <name> <number>"), then "done". 4 x 3 cells per rank on a
 * periodic 2-D grid from MPI_Dims_create; u(x, y) = sin(0.3 x + 0.7 y) and
 * v = cos(0.5 x - 0.2 y) in global indices, so the test can rebuild them.
 */
#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "domainpar.h"

enum { NX = 4, NY = 3 };
static FILE *out;

static void record(const char *name, int rc) {
  fprintf(out, "case %s code %d message %s\n", name, rc, dp_last_error());
  fflush(out);
}

int main(int argc, char **argv) {
  int rank, size, dims[2] = {0, 0}, periods[2] = {1, 1}, coords[2];
  char path[4096], options[256];
  MPI_Comm cart;
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (argc < 4) MPI_Abort(MPI_COMM_WORLD, 2);
  snprintf(path, sizeof path, "%s/rank%d.txt", argv[1], rank);
  out = fopen(path, "w");
  const char *mode = argv[2], *entry = argv[3];
  const int last = size - 1;
  MPI_Dims_create(size, 2, dims);
  MPI_Cart_create(MPI_COMM_WORLD, 2, dims, periods, 0, &cart);
  MPI_Cart_coords(cart, rank, 2, coords);

  double u[NX * NY], v[NX * NY], w[NX * NY];
  for (int i = 0; i < NX; i++)
    for (int j = 0; j < NY; j++) {
      int x = coords[0] * NX + i, y = coords[1] * NY + j;
      u[i * NY + j] = sin(0.3 * x + 0.7 * y);
      v[i * NY + j] = cos(0.5 * x - 0.2 * y);
      w[i * NY + j] = 0;
    }
  int shape[2] = {NX, NY}, fu = 0, fv = 0, fw = 0, model = 0;
  double loss = -1;

  if (!strcmp(mode, "comm_null") || !strcmp(mode, "other_comm")) {
    MPI_Comm mine = rank != last ? cart : !strcmp(mode, "comm_null") ? MPI_COMM_NULL
                                                                     : MPI_COMM_WORLD;
    record("init", dp_init(mine, 0, NULL, NULL));
    record("infer_after", dp_infer(1, 1, 2));  /* local: not initialised */
    fprintf(out, "done\n");
    fclose(out);
    /* Wait for every rank by messages (a collective could meet a pending dp_init),
     * then end: the communicator may be unusable (documented), so abort. */
    int token = 0;
    if (rank == 0) {
      for (int r = 1; r < size; r++)
        MPI_Recv(&token, 1, MPI_INT, r, 99, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
      for (int r = 1; r < size; r++) MPI_Send(&token, 1, MPI_INT, r, 98, MPI_COMM_WORLD);
    } else {
      MPI_Send(&token, 1, MPI_INT, 0, 99, MPI_COMM_WORLD);
      MPI_Recv(&token, 1, MPI_INT, 0, 98, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
    }
    MPI_Abort(MPI_COMM_WORLD, 0);
  }
  if (!strcmp(mode, "python_broken") && rank == last)
    setenv("DOMAINPAR_PYTHON", "/no/such/python", 1);
  record("init", dp_init(cart, 0, NULL, NULL));
  if (!strcmp(mode, "python_broken")) {
    record("infer_after", dp_infer(1, 1, 2));
  } else {
    record("field_u", dp_field_create(&fu, u, DP_FLOAT64, DP_ORDER_C, 2, shape, NULL, NULL));
    record("field_v", dp_field_create(&fv, v, DP_FLOAT64, DP_ORDER_C, 2, shape, NULL, NULL));
    record("field_w", dp_field_create(&fw, w, DP_FLOAT64, DP_ORDER_C, 2, shape, NULL, NULL));
  }
  if (!strcmp(mode, "finalize_one")) {
    if (rank == 0) {
      record("finalize", dp_finalize());
    } else {
      record("finalize", dp_infer(1, fu, fv));  /* meets rank 0's dp_finalize */
      record("next_call", dp_halo_fill(fu));
      record("own_finalize", dp_finalize());
    }
  } else if (!strcmp(mode, "options_differ")) {
    snprintf(options, sizeof options, "{\"dtype\": \"float64\", \"optimizer\": {\"name\": "
             "\"sgd\", \"lr\": %s}}", rank == last ? "0.2" : "0.1");
    record("load", dp_model_load(&model, entry, NULL, options));
  } else if (!strcmp(mode, "handles_differ")) {
    record("load", dp_model_load(&model, entry, NULL, "{\"dtype\": \"float64\"}"));
    record("infer", dp_infer(model, rank == last ? fv : fu, fw));
    record("infer_ok", dp_infer(model, fu, fw));
  } else if (!strcmp(mode, "raise_first")) {
    snprintf(options, sizeof options, "{\"raise_first_on\": [%d]}", last);
    record("load", dp_model_load(&model, entry, options, "{\"dtype\": \"float64\"}"));
    record("infer", dp_infer(model, fu, fw));
  } else if (!strcmp(mode, "rank_only_param")) {
    record("load", dp_model_load(&model, entry, "{\"digest\": true}", "{\"dtype\": \"float64\", "
                                 "\"optimizer\": {\"name\": \"sgd\", \"lr\": 0.1}}"));
    for (int s = 0; s < 3; s++) {
      char name[32];
      snprintf(name, sizeof name, "train%d", s);
      record(name, dp_train_step(model, fu, fv, &loss));
      fprintf(out, "value loss%d %.17g\n", s, loss);
    }
    record("infer", dp_infer(model, fu, fw));
    fprintf(out, "value digest %.17g\n", w[0]);
  }
  if (strcmp(mode, "finalize_one")) record("finalize", dp_finalize());
  fprintf(out, "done\n");
  fclose(out);
  MPI_Comm_free(&cart);
  MPI_Finalize();
  return 0;
}
