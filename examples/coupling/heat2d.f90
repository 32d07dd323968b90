! 2-D heat equation with an online-trained domain-parallel surrogate (Fortran).
!
!   u_t = laplacian(u) on a periodic NX x NY grid, explicit Euler
!   u' = u + ALPHA * (u(i-1,j) + u(i+1,j) + u(i,j-1) + u(i,j+1) - 4 u(i,j)),
!
! decomposed over a periodic 2-D Cartesian grid of MPI ranks (MPI_Dims_create),
! each rank holding u(0:nx+1, 0:ny+1): its block plus one ghost layer, i along
! grid axis 0 (x), j along axis 1 (y). Every KICK steps a travelling sine wave
! is stirred in, so the field never decays to a state with nothing to learn.
!
! Every EVERY steps the field u and the solver's next field go to a small CNN
! (heat_surrogate.py) through the domainpar module: dp_infer predicts the next
! field from u (printed: its error against the solver, the size of the step,
! the relative error), then dp_train_step trains the model on the pair. The
! model runs domain-parallel on the blocks, reading these arrays in place.
! At the start, dp_halo_fill is checked against this program's own exchange.
! The twin of heat2d.c; see there for the output and the dump_dir argument.
!
! Usage: mpiexec -n 4 heat2d_f [dump_dir|-] [steps (default 240)]
program heat2d
  use mpi
  use domainpar
  use heat2d_config, only: default_surrogate
  implicit none
  integer, parameter :: GNX = 32, GNY = 32, EVERY = 2, KICK = 3
  double precision, parameter :: ALPHA = 0.2d0, PI = 3.14159265358979323846d0
  double precision, allocatable, target :: u(:,:), next(:,:), pred(:,:), probe(:,:)
  integer :: ierr, rank, nprocs, cart, dims(2), coords(2), nx, ny, x0, y0, row
  integer :: fu, fnext, fpred, fprobe, model, step, steps, i, j, s, unit
  double precision :: e(2), diff, loss, first
  character(len=4096) :: dump, entry
  character(len=16) :: rank_text

  call MPI_Init(ierr)
  dump = "-"
  steps = 240
  if (command_argument_count() > 0) call get_command_argument(1, dump)
  if (command_argument_count() > 1) then
    call get_command_argument(2, entry)
    read (entry, *) steps
  end if
  call MPI_Comm_size(MPI_COMM_WORLD, nprocs, ierr)
  call MPI_Comm_rank(MPI_COMM_WORLD, rank, ierr)
  dims = 0
  call MPI_Dims_create(nprocs, 2, dims, ierr)
  call MPI_Cart_create(MPI_COMM_WORLD, 2, dims, [.true., .true.], .false., cart, ierr)
  call MPI_Cart_coords(cart, rank, 2, coords, ierr)
  call block(GNX, dims(1), coords(1), nx, x0)
  call block(GNY, dims(2), coords(2), ny, y0)
  allocate(u(0:nx+1, 0:ny+1), next(0:nx+1, 0:ny+1), probe(0:nx+1, 0:ny+1), pred(nx, ny))
  call MPI_Type_vector(ny + 2, 1, nx + 2, MPI_DOUBLE_PRECISION, row, ierr)
  call MPI_Type_commit(row, ierr)
  u = 0
  next = 0
  do s = 0, 7
    call stir(u, s)
  end do

  ! domainpar on this program's own Cartesian communicator.
  call check(dp_init(cart), "dp_init")
  call check(dp_field_create(fu, u, ghost=1, global_offset=[x0, y0]), "dp_field_create(u)")
  call check(dp_field_create(fnext, next, ghost=1), "dp_field_create(next)")
  call check(dp_field_create(fpred, pred), "dp_field_create(pred)")  ! no ghosts
  call check(dp_field_create(fprobe, probe, ghost=1), "dp_field_create(probe)")

  ! Halo check: the same field with ghosts set to junk, exchanged both ways.
  probe = -1
  probe(1:nx, 1:ny) = u(1:nx, 1:ny)
  next = probe
  call exchange(next)
  call check(dp_halo_fill(fprobe), "dp_halo_fill")
  diff = maxval(abs(probe - next))
  call MPI_Allreduce(MPI_IN_PLACE, diff, 1, MPI_DOUBLE_PRECISION, MPI_MAX, cart, ierr)
  if (rank == 0) write (*, '(a,g0)') "halo check: max |dp_halo_fill - own exchange| = ", diff

  call get_environment_variable("DOMAINPAR_SURROGATE", entry)
  if (len_trim(entry) == 0) entry = default_surrogate
  call check(dp_model_load(model, trim(entry), '{"channels": 8}', &
       '{"optimizer": {"name": "adam", "lr": 0.02}, "dtype": "float64"}'), "dp_model_load")

  first = -1
  loss = 0
  do step = 1, steps
    if (mod(step, KICK) == 0) call stir(u, step)
    call exchange(u)
    do j = 1, ny
      do i = 1, nx
        next(i, j) = u(i, j) + ALPHA * (u(i-1, j) + u(i+1, j) + u(i, j-1) + u(i, j+1) &
             - 4 * u(i, j))
      end do
    end do
    if (mod(step, EVERY) == 0) then
      call check(dp_infer(model, fu, fpred), "dp_infer")
      e(1) = maxval(abs(pred - next(1:nx, 1:ny)))       ! prediction against the solver
      e(2) = maxval(abs(next(1:nx, 1:ny) - u(1:nx, 1:ny)))  ! the solver's step
      call MPI_Allreduce(MPI_IN_PLACE, e, 2, MPI_DOUBLE_PRECISION, MPI_MAX, cart, ierr)
      call check(dp_train_step(model, fu, fnext, loss), "dp_train_step")
      if (first < 0) first = loss
      if (rank == 0) write (*, '(a,i0,4(a,es14.6e3))') "step ", step, " loss ", loss, &
           " err ", e(1), " change ", e(2), " rel ", e(1) / e(2)
    end if
    u(1:nx, 1:ny) = next(1:nx, 1:ny)
  end do

  if (trim(dump) /= "-") then  ! end state, its prediction, the model: for the tests
    call check(dp_infer(model, fu, fpred), "dp_infer")
    call check(dp_model_save(model, trim(dump) // "/model.pt"), "dp_model_save")
    write (rank_text, '(i0)') rank
    open (newunit=unit, file=trim(dump) // "/rank" // trim(rank_text) // ".bin", &
         access="stream", form="unformatted", status="replace")
    write (unit) int([DP_ORDER_F, x0, y0, nx, ny], kind=4)
    write (unit) u(1:nx, 1:ny), pred
    close (unit)
  end if
  if (rank == 0) write (*, '(a,es14.6e3,a,es14.6e3,a,f0.1)') "done: first loss ", first, &
       ", last loss ", loss, ", ratio ", first / loss
  call check(dp_finalize(), "dp_finalize")
  call MPI_Type_free(row, ierr)
  call MPI_Comm_free(cart, ierr)
  call MPI_Finalize(ierr)

contains

  !> Stop on a failed call: this example's choice; every rank got the same code and message.
  subroutine check(rc, what)
    integer, intent(in) :: rc
    character(len=*), intent(in) :: what
    if (rc == DP_OK) return
    write (*, '(a,i0,a,a,a,i0,a,a)') "rank ", rank, ": ", what, " failed (code ", rc, "): ", &
         dp_last_error()
    call MPI_Abort(MPI_COMM_WORLD, 1, ierr)
  end subroutine check

  !> Block sizes: the first mod(n, p) coordinates get one more cell (domainpar's balance, too).
  subroutine block(n, p, c, size, offset)
    integer, intent(in) :: n, p, c
    integer, intent(out) :: size, offset
    size = n / p
    if (c < mod(n, p)) size = size + 1
    offset = c * (n / p) + min(c, mod(n, p))
  end subroutine block

  !> Add the wave of step s (the start is the sum of s = 0..7).
  subroutine stir(a, s)
    double precision, intent(inout) :: a(0:, 0:)
    integer, intent(in) :: s
    integer :: i, j, kx, ky
    kx = 1 + mod(s, 5)
    ky = 1 + mod(s / 5, 4)
    do j = 1, ny
      do i = 1, nx
        a(i, j) = a(i, j) + 0.3d0 * sin(2 * PI * (kx * (x0 + i - 1) + ky * (y0 + j - 1)) / GNX &
             + 0.7d0 * s)
      end do
    end do
  end subroutine stir

  !> This program's own ghost exchange: planes i = const along x (strided), then
  !> whole columns (ghost rows included) along y, so corners arrive in the second round.
  subroutine exchange(a)
    double precision, intent(inout) :: a(0:, 0:)
    integer :: lo, hi, status(MPI_STATUS_SIZE)
    call MPI_Cart_shift(cart, 0, 1, lo, hi, ierr)
    call MPI_Sendrecv(a(1, 0), 1, row, lo, 0, a(nx+1, 0), 1, row, hi, 0, cart, status, ierr)
    call MPI_Sendrecv(a(nx, 0), 1, row, hi, 1, a(0, 0), 1, row, lo, 1, cart, status, ierr)
    call MPI_Cart_shift(cart, 1, 1, lo, hi, ierr)
    call MPI_Sendrecv(a(0, 1), nx + 2, MPI_DOUBLE_PRECISION, lo, 2, a(0, ny+1), nx + 2, &
         MPI_DOUBLE_PRECISION, hi, 2, cart, status, ierr)
    call MPI_Sendrecv(a(0, ny), nx + 2, MPI_DOUBLE_PRECISION, hi, 3, a(0, 0), nx + 2, &
         MPI_DOUBLE_PRECISION, lo, 3, cart, status, ierr)
  end subroutine exchange

end program heat2d
