! Fortran interface of libdomainpar (see domainpar.h for the semantics of
! every call): the same calls on Fortran arrays and an integer communicator.
!
!   use mpi
!   use domainpar
!   ierr = dp_init(cart_comm)                       ! the communicator's Cartesian topology
!   ierr = dp_field_create(fu, u, ghost=1)          ! u(0:nx+1, 0:ny+1), real64 or real32
!   ierr = dp_model_load(model, "heat_surrogate:make_surrogate", &
!                        '{"channels": 8}', '{"optimizer": {"name": "adam", "lr": 0.02}}')
!   ierr = dp_infer(model, fu, fpred)
!   ierr = dp_train_step(model, fu, fnext, loss)
!   if (ierr /= DP_OK) print *, dp_last_error()
!   ierr = dp_finalize()
!
! Every function returns DP_OK or a DP_ERR_* code, the same on every rank.
! Fields: the array is described by its own shape minus the ghost widths, in
! Fortran order; dim d is cut along grid axis d-1 (MPI's coordinates count
! from 0), a last extra dim holds components. The library keeps the array's
! address, so the actual argument must have the TARGET (or POINTER) attribute,
! be contiguous and stay allocated until dp_field_free or dp_finalize.
! Communicators are integer handles (with mpi_f08 pass comm%MPI_VAL).
module domainpar
  use, intrinsic :: iso_c_binding
  implicit none
  private

  integer, parameter, public :: DP_OK = 0, DP_ERR_ARGUMENT = 1, DP_ERR_SHAPE = 2, &
       DP_ERR_IMPORT = 3, DP_ERR_MODEL = 4, DP_ERR_IO = 5, DP_ERR_STATE = 6, DP_ERR_PYTHON = 7
  integer, parameter, public :: DP_FLOAT32 = 1, DP_FLOAT64 = 2
  integer, parameter, public :: DP_ORDER_C = 0, DP_ORDER_F = 1
  integer, parameter, public :: DP_HOST = 0, DP_DEVICE = 1

  public :: dp_init, dp_field_create, dp_field_create_ptr, dp_field_free, dp_halo_fill, &
       dp_model_load, dp_model_free, dp_infer, dp_train_step, dp_model_save, &
       dp_model_restore, dp_finalize, dp_last_error

  ! One generic name for real32 and real64 arrays of any rank (assumed rank:
  ! no copy-in, so the address is the caller's own array). The two specifics
  ! differ in the declared kind only: Fortran gives c_loc no kind-generic
  ! dummy short of type(*) with C descriptors, which is more machinery.
  interface dp_field_create
    module procedure field_create_r8, field_create_r4
  end interface dp_field_create

  interface
    function c_init_f(comm, ndims, dims, periods) bind(C, name="dp_init_f") result(rc)
      import :: c_int, c_ptr
      integer(c_int), value :: comm, ndims
      type(c_ptr), value :: dims, periods
      integer(c_int) :: rc
    end function c_init_f

    function c_field_create(field, data, dtype, order, ndim, shape, ghost_lo, ghost_hi, axes, &
         global_offset, location, local_problem) bind(C, name="dp_field_create_checked") result(rc)
      import :: c_int, c_ptr, c_char
      integer(c_int), intent(out) :: field
      type(c_ptr), value :: data
      integer(c_int), value :: dtype, order, ndim, location
      integer(c_int), intent(in) :: shape(*), ghost_lo(*), ghost_hi(*)
      type(c_ptr), value :: axes, global_offset
      character(kind=c_char), intent(in) :: local_problem(*)
      integer(c_int) :: rc
    end function c_field_create

    function c_field_free(field) bind(C, name="dp_field_free") result(rc)
      import :: c_int
      integer(c_int), value :: field
      integer(c_int) :: rc
    end function c_field_free

    function c_halo_fill(field) bind(C, name="dp_halo_fill") result(rc)
      import :: c_int
      integer(c_int), value :: field
      integer(c_int) :: rc
    end function c_halo_fill

    function c_model_free(model) bind(C, name="dp_model_free") result(rc)
      import :: c_int
      integer(c_int), value :: model
      integer(c_int) :: rc
    end function c_model_free

    function c_model_load(model, entry, kwargs, options) bind(C, name="dp_model_load") result(rc)
      import :: c_int, c_char
      integer(c_int), intent(out) :: model
      character(kind=c_char), intent(in) :: entry(*), kwargs(*), options(*)
      integer(c_int) :: rc
    end function c_model_load

    function c_infer(model, field_in, field_out) bind(C, name="dp_infer") result(rc)
      import :: c_int
      integer(c_int), value :: model, field_in, field_out
      integer(c_int) :: rc
    end function c_infer

    function c_train_step(model, field_in, field_target, loss) bind(C, name="dp_train_step") &
         result(rc)
      import :: c_int, c_double
      integer(c_int), value :: model, field_in, field_target
      real(c_double), intent(out) :: loss
      integer(c_int) :: rc
    end function c_train_step

    function c_model_save(model, path) bind(C, name="dp_model_save") result(rc)
      import :: c_int, c_char
      integer(c_int), value :: model
      character(kind=c_char), intent(in) :: path(*)
      integer(c_int) :: rc
    end function c_model_save

    function c_model_restore(model, path) bind(C, name="dp_model_restore") result(rc)
      import :: c_int, c_char
      integer(c_int), value :: model
      character(kind=c_char), intent(in) :: path(*)
      integer(c_int) :: rc
    end function c_model_restore

    function c_finalize() bind(C, name="dp_finalize") result(rc)
      import :: c_int
      integer(c_int) :: rc
    end function c_finalize

    function c_last_error() bind(C, name="dp_last_error") result(p)
      import :: c_ptr
      type(c_ptr) :: p
    end function c_last_error

    function c_strlen(s) bind(C, name="strlen") result(n)
      import :: c_ptr, c_size_t
      type(c_ptr), value :: s
      integer(c_size_t) :: n
    end function c_strlen
  end interface

contains

  !> Start domainpar on the simulation's grid: comm's own Cartesian topology, or
  !> (with dims, and periods: one per dim) a Cartesian grid made over comm
  !> without reordering.
  integer function dp_init(comm, dims, periods) result(rc)
    integer, intent(in) :: comm
    integer, intent(in), optional :: dims(:)
    logical, intent(in), optional :: periods(:)
    integer(c_int), allocatable, target :: d(:), p(:)
    integer :: n
    if (.not. present(dims)) then
      rc = c_init_f(int(comm, c_int), 0_c_int, c_null_ptr, c_null_ptr)
      return
    end if
    n = size(dims)
    allocate(d(n), p(n))
    d = int(dims, c_int)
    p = 0
    if (present(periods)) then
      n = min(n, size(periods))
      where (periods(1:n)) p(1:n) = 1
    end if
    rc = c_init_f(int(comm, c_int), int(size(d), c_int), c_loc(d), c_loc(p))
  end function dp_init

  !> Describe a real64 array (ghosts included) as a field.
  integer function field_create_r8(field, u, ghost, ghost_lo, ghost_hi, axes, global_offset) &
       result(rc)
    integer, intent(out) :: field
    real(c_double), dimension(..), target, intent(inout) :: u
    integer, intent(in), optional :: ghost, ghost_lo(:), ghost_hi(:), axes(:), global_offset(:)
    type(c_ptr) :: data
    data = c_null_ptr
    if (is_contiguous(u)) data = c_loc(u)
    rc = field_common(field, data, DP_FLOAT64, shape(u), is_contiguous(u), ghost, ghost_lo, &
         ghost_hi, axes, global_offset)
  end function field_create_r8

  !> Describe a real32 array (ghosts included) as a field.
  integer function field_create_r4(field, u, ghost, ghost_lo, ghost_hi, axes, global_offset) &
       result(rc)
    integer, intent(out) :: field
    real(c_float), dimension(..), target, intent(inout) :: u
    integer, intent(in), optional :: ghost, ghost_lo(:), ghost_hi(:), axes(:), global_offset(:)
    type(c_ptr) :: data
    data = c_null_ptr
    if (is_contiguous(u)) data = c_loc(u)
    rc = field_common(field, data, DP_FLOAT32, shape(u), is_contiguous(u), ghost, ghost_lo, &
         ghost_hi, axes, global_offset)
  end function field_create_r4

  !> Describe memory given as a C pointer (extents include the ghosts; Fortran
  !> order unless order says otherwise): for device memory (location=DP_DEVICE)
  !> or arrays allocated in C.
  integer function dp_field_create_ptr(field, data, dtype, extents, ghost, ghost_lo, ghost_hi, &
       axes, global_offset, order, location) result(rc)
    integer, intent(out) :: field
    type(c_ptr), intent(in) :: data
    integer, intent(in) :: dtype, extents(:)
    integer, intent(in), optional :: ghost, ghost_lo(:), ghost_hi(:), axes(:), global_offset(:)
    integer, intent(in), optional :: order, location
    integer :: o, l
    o = DP_ORDER_F
    l = DP_HOST
    if (present(order)) o = order
    if (present(location)) l = location
    rc = field_common(field, data, dtype, extents, .true., ghost, ghost_lo, ghost_hi, axes, &
         global_offset, o, l)
  end function dp_field_create_ptr

  integer function field_common(field, data, dtype, extents, contiguous, ghost, ghost_lo, &
       ghost_hi, axes, global_offset, order, location) result(rc)
    integer, intent(out) :: field
    type(c_ptr), intent(in) :: data
    integer, intent(in) :: dtype, extents(:)
    logical, intent(in) :: contiguous
    integer, intent(in), optional :: ghost, ghost_lo(:), ghost_hi(:), axes(:), global_offset(:)
    integer, intent(in), optional :: order, location
    integer(c_int), allocatable, target :: lo(:), hi(:), owned(:), ax(:), off(:)
    type(c_ptr) :: ax_ptr, off_ptr
    character(len=:), allocatable :: problem
    integer(c_int) :: handle
    integer :: n, o, l
    n = size(extents)
    o = DP_ORDER_F
    l = DP_HOST
    if (present(order)) o = order
    if (present(location)) l = location
    allocate(lo(n), hi(n), ax(n), off(n))
    lo = 0
    hi = 0
    ax = 0
    off = 0
    problem = ""
    if (present(ghost)) then
      lo = ghost
      hi = ghost
    end if
    if (.not. contiguous) problem = "the array is not contiguous (a strided section?): " // &
         "pass a whole array; the library keeps its address"
    call take(lo, ghost_lo, "ghost_lo")
    call take(hi, ghost_hi, "ghost_hi")
    call take(ax, axes, "axes")
    call take(off, global_offset, "global_offset")
    owned = int(extents, c_int) - lo - hi
    ax_ptr = c_null_ptr
    off_ptr = c_null_ptr
    if (present(axes)) ax_ptr = c_loc(ax)
    if (present(global_offset)) off_ptr = c_loc(off)
    rc = c_field_create(handle, data, int(dtype, c_int), int(o, c_int), int(n, c_int), owned, &
         lo, hi, ax_ptr, off_ptr, int(l, c_int), problem // c_null_char)
    field = handle
  contains
    subroutine take(dst, src, what)
      integer(c_int), intent(inout) :: dst(:)
      integer, intent(in), optional :: src(:)
      character(len=*), intent(in) :: what
      character(len=16) :: a, b
      if (.not. present(src)) return
      if (size(src) /= size(dst)) then
        write (a, '(i0)') size(src)
        write (b, '(i0)') size(dst)
        if (len(problem) == 0) problem = what // " has " // trim(a) // " entries for an array of rank " // trim(b)
        return
      end if
      dst = int(src, c_int)
    end subroutine take
  end function field_common

  integer function dp_field_free(field) result(rc)
    integer, intent(in) :: field
    rc = c_field_free(int(field, c_int))
  end function dp_field_free

  !> Fill the field's ghost cells from their owners (domainpar's halo exchange).
  integer function dp_halo_fill(field) result(rc)
    integer, intent(in) :: field
    rc = c_halo_fill(int(field, c_int))
  end function dp_halo_fill

  !> Load a model from "package.module:factory" or "/path/file.py:factory";
  !> kwargs and options are JSON objects (see domainpar.h).
  integer function dp_model_load(model, entry, kwargs, options) result(rc)
    integer, intent(out) :: model
    character(len=*), intent(in) :: entry
    character(len=*), intent(in), optional :: kwargs, options
    character(len=:), allocatable :: k, o
    integer(c_int) :: handle
    k = ""
    o = ""
    if (present(kwargs)) k = trim(kwargs)
    if (present(options)) o = trim(options)
    rc = c_model_load(handle, trim(entry) // c_null_char, k // c_null_char, o // c_null_char)
    model = handle
  end function dp_model_load

  integer function dp_model_free(model) result(rc)
    integer, intent(in) :: model
    rc = c_model_free(int(model, c_int))
  end function dp_model_free

  !> field_out <- model(field_in)
  integer function dp_infer(model, field_in, field_out) result(rc)
    integer, intent(in) :: model, field_in, field_out
    rc = c_infer(int(model, c_int), int(field_in, c_int), int(field_out, c_int))
  end function dp_infer

  !> One optimizer step on loss(model(field_in), field_target); loss: before the step.
  integer function dp_train_step(model, field_in, field_target, loss) result(rc)
    integer, intent(in) :: model, field_in, field_target
    real(c_double), intent(out) :: loss
    rc = c_train_step(int(model, c_int), int(field_in, c_int), int(field_target, c_int), loss)
  end function dp_train_step

  integer function dp_model_save(model, path) result(rc)
    integer, intent(in) :: model
    character(len=*), intent(in) :: path
    rc = c_model_save(int(model, c_int), trim(path) // c_null_char)
  end function dp_model_save

  integer function dp_model_restore(model, path) result(rc)
    integer, intent(in) :: model
    character(len=*), intent(in) :: path
    rc = c_model_restore(int(model, c_int), trim(path) // c_null_char)
  end function dp_model_restore

  integer function dp_finalize() result(rc)
    rc = c_finalize()
  end function dp_finalize

  !> The message of this rank's last failed call ("" after a success).
  function dp_last_error() result(msg)
    character(len=:), allocatable :: msg
    character(kind=c_char), pointer :: chars(:)
    type(c_ptr) :: p
    integer :: n, i
    p = c_last_error()
    n = int(c_strlen(p))
    allocate(character(len=n) :: msg)
    if (n == 0) return
    call c_f_pointer(p, chars, [n])
    do i = 1, n
      msg(i:i) = chars(i)
    end do
  end function dp_last_error

end module domainpar
