from cakemp import errors


def test_every_cakemp_error_derives_from_one_root():
    """Callers can catch CakempError and know they caught only cakemp's own faults."""
    declared = [v for v in vars(errors).values() if isinstance(v, type) and issubclass(v, Exception)]
    assert len(declared) > 5
    assert all(issubclass(e, errors.CakempError) for e in declared)


def test_request_errors_are_distinct_from_protocol_errors():
    """A bad request keeps the connection (WorkerError); a protocol error closes it."""
    assert issubclass(errors.CacheBudgetExceeded, errors.RequestError)
    assert not issubclass(errors.ProtocolError, errors.RequestError)
