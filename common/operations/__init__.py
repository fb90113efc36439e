"""Operations surfaces: the ops HTTP, the fleet view and dashboard, the Admin
API, topology reload."""
