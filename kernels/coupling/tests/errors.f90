! Error-path driver for tests/test_coupling.py: bad input through the Fortran module.
!
! Usage: mpiexec -n N coupling_errors_f OUT_DIR SURROGATE_ENTRY
! Writes OUT_DIR/rank<r>.txt like coupling_errors_c: "case <name> code <rc>
! message <dp_last_error()>" per case and "done" at the end.
program coupling_errors
  use mpi
  use domainpar
  implicit none
  integer, parameter :: NX = 4, NY = 3
  double precision, target :: u(0:NX+1, 0:NY+1), v(0:NX+1, 0:NY+1), two(NX, NY, 2)
  integer :: ierr, rank, nprocs, cart, dims(2), unit, fu, fv, f, fc, model, bad_model
  character(len=4096) :: outdir, entry
  character(len=16) :: text
  character(len=64) :: kwargs
  double precision :: loss

  call MPI_Init(ierr)
  call MPI_Comm_rank(MPI_COMM_WORLD, rank, ierr)
  call MPI_Comm_size(MPI_COMM_WORLD, nprocs, ierr)
  call get_command_argument(1, outdir)
  call get_command_argument(2, entry)
  write (text, '(i0)') rank
  open (newunit=unit, file=trim(outdir) // "/rank" // trim(text) // ".txt", status="replace")
  dims = 0
  call MPI_Dims_create(nprocs, 2, dims, ierr)
  call MPI_Cart_create(MPI_COMM_WORLD, 2, dims, [.true., .true.], .false., cart, ierr)
  u = 1
  v = 2
  two = 0

  ! A grid made by domainpar from dims and periods (the other way to init).
  call record("init", dp_init(MPI_COMM_WORLD, dims, [.true., .true.]))
  call record("field_ok", dp_field_create(fu, u, ghost=1))
  call record("field_ok2", dp_field_create(fv, v, ghost=1))
  ! A strided section: the library keeps addresses, so it refuses (every rank).
  call record("not_contiguous", dp_field_create(f, u(0:NX:2, :)))
  ! Ghost widths larger than the array: negative owned extents.
  call record("ghost_too_wide", dp_field_create(f, u, ghost=4))
  call record("ghost_lo_size", dp_field_create(f, u, ghost_lo=[1, 1, 1]))
  call record("import_module", dp_model_load(model, "no_such_module_xyz:factory"))

  write (kwargs, '(a,i0,a)') '{"channels": 2, "raise_on_ranks": [', nprocs - 1, ']}'
  call record("load_failing_model_last", dp_model_load(bad_model, trim(entry), trim(kwargs), &
       '{"dtype": "float64", "optimizer": "adam"}'))
  call record("model_raises_on_last", dp_train_step(bad_model, fu, fv, loss))

  call record("load_model", dp_model_load(model, trim(entry), '{"channels": 2}', &
       '{"dtype": "float64"}'))
  call record("field_components", dp_field_create(fc, two))
  call record("wrong_shape_output", dp_infer(model, fu, fc))
  call record("unknown_field", dp_halo_fill(12345))

  call record("infer_ok", dp_infer(model, fu, fv))
  call record("halo_ok", dp_halo_fill(fu))
  call record("finalize", dp_finalize())
  write (unit, '(a)') "done"
  close (unit)
  call MPI_Comm_free(cart, ierr)
  call MPI_Finalize(ierr)

contains

  subroutine record(name, rc)
    character(len=*), intent(in) :: name
    integer, intent(in) :: rc
    write (unit, '(a,a,a,i0,a,a)') "case ", name, " code ", rc, " message ", dp_last_error()
    flush (unit)
  end subroutine record

end program coupling_errors
