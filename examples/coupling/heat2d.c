/*
 * 2-D heat equation with an online-trained domain-parallel surrogate (C).
 *
 *   u_t = laplacian(u) on a periodic NX x NY grid, explicit Euler
 *   u' = u + ALPHA * (u[i-1][j] + u[i+1][j] + u[i][j-1] + u[i][j+1] - 4 u[i][j]),
 *
 * decomposed over a periodic 2-D Cartesian grid of MPI ranks (MPI_Dims_create),
 * each rank holding its block with one ghost layer, C order: u[i][j] with i
 * along grid axis 0 (x), j along axis 1 (y). Every KICK steps a travelling sine
 * wave is stirred in, so the field never decays to a state with nothing to learn.
 *
 * Every EVERY steps the field u and the solver's next field u' go to a small
 * CNN (examples/coupling/heat_surrogate.py) through libdomainpar: dp_infer
 * predicts u' from u (printed: its error against the solver and the size of
 * the step, its relative error), then dp_train_step trains it on (u, u').
 * The model runs domain-parallel on the blocks, reading the simulation's
 * arrays in place. The example is the twin of heat2d.f90; both print:
 *
 *   halo check: max |dp_halo_fill - own exchange| = 0
 *   step 2 loss ... err ... change ... rel ...
 *   done: first loss ..., last loss ..., ratio ...
 *
 * Usage: mpiexec -n 4 heat2d_c [dump_dir|-] [steps (default 240)]
 * With dump_dir, the end state u, the model's prediction from it and the model
 * checkpoint are written there (tests/test_coupling.py recomputes the
 * prediction in one process from them). DOMAINPAR_SURROGATE overrides the
 * model's entry point.
 */
#include <math.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "domainpar.h"

#ifndef HEAT2D_SURROGATE
#define HEAT2D_SURROGATE "heat_surrogate:make_surrogate"
#endif

enum { NX = 32, NY = 32, EVERY = 2, KICK = 3 };
static const double ALPHA = 0.2;

static int rank;

/* Stop on a failed call: this example's choice; every rank got the same code and message. */
static void check(int rc, const char *what) {
  if (rc == DP_OK) return;
  fprintf(stderr, "rank %d: %s failed (code %d): %s\n", rank, what, rc, dp_last_error());
  MPI_Abort(MPI_COMM_WORLD, 1);
}

/* Block sizes: the first n % p coordinates get one more cell (domainpar's balance, too). */
static void block(int n, int p, int c, int *size, int *offset) {
  *size = n / p + (c < n % p);
  *offset = c * (n / p) + (c < n % p ? c : n % p);
}

/* The wave stirred in at step s, at global cell (x, y); s = 0..7 summed is the start. */
static double wave(int s, int x, int y) {
  int kx = 1 + s % 5, ky = 1 + (s / 5) % 4;
  return 0.3 * sin(2.0 * M_PI * (kx * x + ky * y) / NX + 0.7 * s);
}

/* The simulation's own ghost exchange: rows along x, then whole columns
 * (ghost rows included) along y, so corners arrive in the second round. */
static void exchange(double *u, int nx, int ny, MPI_Comm cart, MPI_Datatype column) {
  int lo, hi, w = ny + 2;
  MPI_Cart_shift(cart, 0, 1, &lo, &hi);
  MPI_Sendrecv(&u[1 * w], w, MPI_DOUBLE, lo, 0, &u[(nx + 1) * w], w, MPI_DOUBLE, hi, 0, cart,
               MPI_STATUS_IGNORE);
  MPI_Sendrecv(&u[nx * w], w, MPI_DOUBLE, hi, 1, &u[0], w, MPI_DOUBLE, lo, 1, cart,
               MPI_STATUS_IGNORE);
  MPI_Cart_shift(cart, 1, 1, &lo, &hi);
  MPI_Sendrecv(&u[1], 1, column, lo, 2, &u[ny + 1], 1, column, hi, 2, cart, MPI_STATUS_IGNORE);
  MPI_Sendrecv(&u[ny], 1, column, hi, 3, &u[0], 1, column, lo, 3, cart, MPI_STATUS_IGNORE);
}

int main(int argc, char **argv) {
  int size, dims[2] = {0, 0}, periods[2] = {1, 1}, coords[2];
  MPI_Comm cart;
  MPI_Init(&argc, &argv);
  const char *dump = argc > 1 && strcmp(argv[1], "-") ? argv[1] : NULL;
  const int steps = argc > 2 ? atoi(argv[2]) : 240;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Dims_create(size, 2, dims);
  MPI_Cart_create(MPI_COMM_WORLD, 2, dims, periods, 0, &cart);
  MPI_Cart_coords(cart, rank, 2, coords);
  int nx, ny, x0, y0;
  block(NX, dims[0], coords[0], &nx, &x0);
  block(NY, dims[1], coords[1], &ny, &y0);
  const int w = ny + 2, cells = (nx + 2) * (ny + 2);
#define AT(a, i, j) (a)[(i) * w + (j)]
  MPI_Datatype column;
  MPI_Type_vector(nx + 2, 1, w, MPI_DOUBLE, &column);
  MPI_Type_commit(&column);

  double *u = calloc(cells, sizeof *u), *next = calloc(cells, sizeof *u);
  double *pred = calloc((size_t)nx * ny, sizeof *u), *probe = calloc(cells, sizeof *u);
  for (int i = 1; i <= nx; i++)
    for (int j = 1; j <= ny; j++)
      for (int s = 0; s < 8; s++) AT(u, i, j) += wave(s, x0 + i - 1, y0 + j - 1);

  /* domainpar on the simulation's own Cartesian communicator. */
  check(dp_init(cart, 0, NULL, NULL), "dp_init");
  int shape[2] = {nx, ny}, one[2] = {1, 1}, offset[2] = {x0, y0};
  int fu, fnext, fpred, fprobe;
  check(dp_field_create_ex(&fu, u, DP_FLOAT64, DP_ORDER_C, 2, shape, one, one, NULL, offset,
                           DP_HOST), "dp_field_create(u)");
  check(dp_field_create(&fnext, next, DP_FLOAT64, DP_ORDER_C, 2, shape, one, one),
        "dp_field_create(next)");
  check(dp_field_create(&fpred, pred, DP_FLOAT64, DP_ORDER_C, 2, shape, NULL, NULL),
        "dp_field_create(pred)");  /* no ghosts: a field's ghost widths are its own */
  check(dp_field_create(&fprobe, probe, DP_FLOAT64, DP_ORDER_C, 2, shape, one, one),
        "dp_field_create(probe)");

  /* Halo check: the same field with ghosts set to junk, exchanged both ways. */
  for (int k = 0; k < cells; k++) probe[k] = -1.0;
  for (int i = 1; i <= nx; i++)
    for (int j = 1; j <= ny; j++) AT(probe, i, j) = AT(u, i, j);
  memcpy(next, probe, cells * sizeof *u);
  exchange(next, nx, ny, cart, column);
  check(dp_halo_fill(fprobe), "dp_halo_fill");
  double diff = 0.0;
  for (int k = 0; k < cells; k++) diff = fmax(diff, fabs(probe[k] - next[k]));
  MPI_Allreduce(MPI_IN_PLACE, &diff, 1, MPI_DOUBLE, MPI_MAX, cart);
  if (rank == 0) printf("halo check: max |dp_halo_fill - own exchange| = %g\n", diff);

  const char *entry = getenv("DOMAINPAR_SURROGATE");
  int model;
  check(dp_model_load(&model, entry && *entry ? entry : HEAT2D_SURROGATE, "{\"channels\": 8}",
                      "{\"optimizer\": {\"name\": \"adam\", \"lr\": 0.02}, \"dtype\": \"float64\"}"),
        "dp_model_load");

  double first = -1.0, loss = 0.0;
  for (int step = 1; step <= steps; step++) {
    if (step % KICK == 0)
      for (int i = 1; i <= nx; i++)
        for (int j = 1; j <= ny; j++) AT(u, i, j) += wave(step, x0 + i - 1, y0 + j - 1);
    exchange(u, nx, ny, cart, column);
    for (int i = 1; i <= nx; i++)
      for (int j = 1; j <= ny; j++)
        AT(next, i, j) = AT(u, i, j) + ALPHA * (AT(u, i - 1, j) + AT(u, i + 1, j) +
                                                AT(u, i, j - 1) + AT(u, i, j + 1) - 4 * AT(u, i, j));
    if (step % EVERY == 0) {
      check(dp_infer(model, fu, fpred), "dp_infer");
      double e[2] = {0.0, 0.0};  /* max |prediction - solver|, max |solver step| */
      for (int i = 1; i <= nx; i++)
        for (int j = 1; j <= ny; j++) {
          e[0] = fmax(e[0], fabs(pred[(i - 1) * ny + j - 1] - AT(next, i, j)));
          e[1] = fmax(e[1], fabs(AT(next, i, j) - AT(u, i, j)));
        }
      MPI_Allreduce(MPI_IN_PLACE, e, 2, MPI_DOUBLE, MPI_MAX, cart);
      check(dp_train_step(model, fu, fnext, &loss), "dp_train_step");
      if (first < 0) first = loss;
      if (rank == 0)
        printf("step %d loss %.6e err %.6e change %.6e rel %.6e\n", step, loss, e[0], e[1],
               e[0] / e[1]);
    }
    for (int i = 1; i <= nx; i++) memcpy(&AT(u, i, 1), &AT(next, i, 1), ny * sizeof *u);
  }

  if (dump) {  /* the end state, the prediction from it, the model: for the tests */
    char path[4096];
    check(dp_infer(model, fu, fpred), "dp_infer");
    snprintf(path, sizeof path, "%s/model.pt", dump);
    check(dp_model_save(model, path), "dp_model_save");
    snprintf(path, sizeof path, "%s/rank%d.bin", dump, rank);
    FILE *f = fopen(path, "wb");
    int header[5] = {DP_ORDER_C, x0, y0, nx, ny};
    fwrite(header, sizeof(int), 5, f);
    for (int i = 1; i <= nx; i++) fwrite(&AT(u, i, 1), sizeof *u, ny, f);
    fwrite(pred, sizeof *u, (size_t)nx * ny, f);
    fclose(f);
  }
  if (rank == 0) printf("done: first loss %.6e, last loss %.6e, ratio %.1f\n", first, loss,
                        first / loss);
  check(dp_finalize(), "dp_finalize");
  free(u); free(next); free(pred); free(probe);
  MPI_Type_free(&column);
  MPI_Comm_free(&cart);
  MPI_Finalize();
  return 0;
}
